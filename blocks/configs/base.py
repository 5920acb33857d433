"""The base of every block config."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class BlockConfig(BaseModel):
    """A block's own small config. Subclasses add ``type: Literal["name"] = "name"``.

    Each registered config counts what the block it describes builds:
    ``params(...)`` (exact ``numel``) and ``flops(...)`` (2 per multiply-accumulate of every
    matrix product in one forward pass), beside the fields that decide the shapes.
    """

    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)

    kind: ClassVar[str]
    module_path: ClassVar[str]
