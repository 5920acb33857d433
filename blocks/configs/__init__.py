"""Torch-free configs of the built-in blocks: fields, validation and analytic counts.

Importing this package registers every built-in block (see ``blocks.registry``).
"""

from blocks.configs import architecture, attention, ffn, head, mla, norm, position  # noqa: F401  (registers)
from blocks.configs.base import BlockConfig

__all__ = ["BlockConfig"]
