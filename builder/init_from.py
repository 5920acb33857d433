"""What a run may start from (a recipe's ``model.init_from``), read once:

* a checkpoint of another run (``builder train``: a file or a sharded folder): its spec, weights
  and tokenizer, read and verified by :mod:`yamlformer.builder.checkpoints`;
* a folder written by ``builder import-hf`` (``spec.yaml`` and ``model.safetensors``);
* a Hugging Face model folder (``config.json`` and its weights, converted on the fly by
  :mod:`yamlformer.builder.hf`).

A :class:`Source` (:func:`source_at`) answers the several questions a run asks of it (the spec,
the tokenizer, the weights), each read on demand and once; the weights are handed over once
(:meth:`Source.state`) and not kept. A run makes one, when its recipe is resolved, and keeps it. This module sits above
both :mod:`yamlformer.builder.checkpoints` and :mod:`yamlformer.builder.hf`, which never import it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from yamlformer.builder.spec.loader import read_merged


class SourceError(ValueError):
    """A source that cannot be read: one line naming the path (the caller names its field)."""


@dataclasses.dataclass(eq=False)
class Source:
    """What ``model.init_from`` points at: its kind and path, read on demand and once."""

    kind: str  # checkpoint | imported | hf
    path: Path
    _meta: dict | None = dataclasses.field(default=None, repr=False)
    _spec: dict | None = dataclasses.field(default=None, repr=False)
    _state: dict | None = dataclasses.field(default=None, repr=False)  # an HF folder's, read with its spec

    def describe(self) -> str:
        return {"checkpoint": "run checkpoint", "imported": "imported folder", "hf": "Hugging Face folder"}[self.kind]

    def _builder(self) -> dict:
        """A run checkpoint's ``builder`` record (spec, tokenizer), verified."""
        # local: a source's readers load when it is read; the recipe's sections import this module torch-free
        from yamlformer.builder.checkpoints import CheckpointError, read_meta

        if self._meta is None:
            try:
                meta = read_meta(self.path)["builder"]
            except CheckpointError as exc:
                raise SourceError(str(exc)) from None
            if not isinstance(meta.get("spec"), dict):
                raise SourceError(f"{self.path} was not written by `builder train` (it holds no spec)")
            self._meta = dict(meta)
        return self._meta

    def _hf(self) -> tuple[dict, dict]:
        """An HF folder's spec and tensors, converted (one read serves both)."""
        # local: a source's readers load when it is read; the recipe's sections import this module torch-free
        from yamlformer.builder.hf import HFError, read_hf

        try:
            spec, _, state = read_hf(self.path)
        except HFError as exc:
            raise SourceError(str(exc)) from None
        return spec, state

    def spec_dict(self) -> dict:
        """The source's spec as plain data (before the recipe's overrides)."""
        if self._spec is None:
            if self.kind == "checkpoint":
                self._spec = dict(self._builder()["spec"])
            elif self.kind == "imported":
                self._spec = dict(read_merged(self.path / "spec.yaml").data)
            else:
                self._spec, self._state = self._hf()
        return dict(self._spec)

    def state(self) -> dict[str, Any]:
        """The tensors, under the built model's names; handed over, not kept."""
        if self.kind == "checkpoint":
            # local: a source's readers load when it is read; the recipe's sections import this module torch-free
            from yamlformer.builder.checkpoints import CheckpointError, model_weights, read_weights

            self._builder()
            try:
                return model_weights(read_weights(self.path))
            except CheckpointError as exc:
                raise SourceError(str(exc)) from None
        if self.kind == "imported":
            # local: a source's readers load when it is read; the recipe's sections import this module torch-free
            from yamlformer.builder.hf import HFError, read_weights

            try:
                return read_weights(self.path / "model.safetensors")
            except HFError as exc:
                raise SourceError(str(exc)) from None
        state, self._state = self._state, None
        if state is None:
            self._spec, state = self._hf()
        return state

    def tokenizer_state(self) -> dict | None:
        """A run checkpoint's tokenizer (None for the folders: the recipe's tokenizer is used)."""
        return self._builder().get("tokenizer") if self.kind == "checkpoint" else None


def _kind(path: Path) -> str:
    # local: a source's readers load when it is read; the recipe's sections import this module torch-free
    from yamlformer.builder.checkpoints import is_sharded, looks_like_checkpoint

    if (path.is_file() and looks_like_checkpoint(path)) or is_sharded(path):
        return "checkpoint"
    if path.is_dir() and (path / "spec.yaml").is_file() and (path / "model.safetensors").is_file():
        return "imported"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    what = "no file or folder" if not path.exists() else "neither"
    raise SourceError(
        f"{path} is {what} a `builder train` checkpoint (a .ckpt file or folder), a folder written by "
        "`builder import-hf` (spec.yaml and model.safetensors) nor a Hugging Face model folder (config.json)"
    )


def source_at(path: str | Path) -> Source:
    """The source at ``path``, nothing read yet; a path that is none of the three kinds is a
    :class:`SourceError`. A run asks it once, when its recipe is resolved, and keeps it
    (``yamlformer.recipes.training.resolved.Run.source``)."""
    path = Path(path)
    return Source(_kind(path), path)
