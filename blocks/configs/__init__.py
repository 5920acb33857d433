"""Torch-free configs of the built-in blocks: fields, validation and analytic counts.

Importing this package imports every module in it, which registers every built-in block (see
``yamlformer.blocks.registry``): a new block's config file joins by being here, with no list to edit.
"""

import importlib
import pkgutil

from yamlformer.blocks.configs.base import BlockConfig

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["BlockConfig"]
