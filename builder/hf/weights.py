"""Reading and writing weights safely: safetensors, or ``torch.load(weights_only=True)``.

:class:`Checkpoint` reads a Hugging Face folder's tensors lazily (``model.safetensors``, the
shards a ``model.safetensors.index.json`` lists, or ``pytorch_model.bin``). :func:`load_weights`
puts a state dict into a built model with errors that name the tensor and both shapes;
:func:`save_weights` writes one with each shared tensor (a tied head, one embedding table for
source and target) stored once.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yamlformer.builder.hf.checks import inside, read_json
from yamlformer.builder.hf.common import HFError
from yamlformer.builder.packages import renamed_global


class Checkpoint:
    """The tensors of a Hugging Face model folder, by name, read on demand.

    Every file is checked to lie inside the folder (:func:`yamlformer.builder.hf.checks.inside`) before it
    is opened: a shard index cannot send the reader elsewhere.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._files: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        self._loaded: dict[str, Any] | None = None
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file() or index.is_symlink():
            self._files = self._shards(index)
        elif single.is_file() or single.is_symlink():
            single = inside(self.folder, single)
            self._files = dict.fromkeys(self._handle(single).keys(), single)
        else:
            bins = sorted(self.folder.glob("pytorch_model*.bin"))
            if not bins:
                raise HFError(
                    f"{self.folder} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
                )
            self._loaded = {}
            for path in bins:
                self._loaded.update(_torch_load(inside(self.folder, path)))
            self._files = dict.fromkeys(self._loaded, bins[0])

    def _shards(self, index: Path) -> dict[str, Path]:
        weight_map = read_json(index, "index", self.folder).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFError(f"{index}: weight_map: expected a mapping of tensor names to shard files")
        files, checked = {}, {}
        for name, file in weight_map.items():
            where = f"weight_map[{_cut(name)!r}]"
            if not isinstance(file, str) or not file:
                raise HFError(f"{index}: {where}: expected a shard file name")
            if file not in checked:
                path = inside(self.folder, self.folder / file, f"{index}: {where} ({_cut(file)!r})")
                if not path.is_file():
                    raise HFError(f"{index}: {where}: the shard {_cut(file)!r} is not in {self.folder}")
                checked[file] = path
            files[name] = checked[file]
        return files

    def names(self) -> set[str]:
        return set(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def file(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        return self._files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, read from the file's header (no data is read)."""
        if self._loaded is not None:
            return tuple(self._loaded[name].shape)
        return tuple(self._read(name, lambda handle: handle.get_slice(name).get_shape()))

    def get(self, name: str):
        if name not in self._files:
            raise KeyError(name)
        if self._loaded is not None:
            return self._loaded[name]
        return self._read(name, lambda handle: handle.get_tensor(name))

    def _read(self, name: str, what):
        path = self._files[name]
        try:
            return what(self._handle(path))
        except HFError:
            raise
        except Exception as exc:
            raise HFError(f"{path}: cannot read tensor {_cut(name)} ({_first_line(exc)})") from None

    def _handle(self, path: Path):
        # local: safetensors loads to read or write weights (builder.hf serves torch-free commands)
        from safetensors import safe_open

        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise HFError(f"{path}: not a safetensors file, or a damaged one ({_first_line(exc)})") from None
        return self._open[path]


def read_weights(path: str | Path) -> dict:
    """A state dict from a ``.safetensors`` file, or a ``.pt``/``.bin`` read with weights_only."""
    path = Path(path)
    if not path.is_file():
        raise HFError(f"no weights file at {path}")
    if path.suffix == ".safetensors":
        # local: safetensors loads to read or write weights (builder.hf serves torch-free commands)
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:
            raise HFError(f"{path}: not a safetensors file, or a damaged one ({_first_line(exc)})") from None
    return _torch_load(path)


def torch_load_safely(path: Path):
    """What a PyTorch file holds, read by ``torch.load(weights_only=True)``: a pickle that holds
    anything but tensors and plain data (code, objects) is refused without being run, as a
    one-line :class:`HFError`."""
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    import torch

    try:
        with warnings.catch_warnings():  # torch's notes on odd pickles: the error below says it all
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        objects = "GLOBAL" in str(exc) or "global" in str(exc)
        reason = "it holds Python objects besides tensors" if objects else "not a tensor-only pickle (or damaged)"
        raise HFError(
            f"{path}: not a checkpoint this tool can load safely: "
            + (renamed_global(str(exc)) or f"{reason}; only safetensors files and tensor-only PyTorch files are read")
        ) from None
    except Exception:
        # torch's reason is not shown: it can quote the file's bytes
        raise HFError(f"{path}: not a PyTorch weights file, or a damaged one") from None


def _torch_load(path: Path) -> dict:
    """A state dict (names to tensors) from a PyTorch file, read safely."""
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    import torch

    state = torch_load_safely(path)
    if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HFError(f"{path}: does not hold a state dict (names to tensors)")
    return dict(state)


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def alias_groups(model) -> list[list[str]]:
    """Names that share one tensor (tied head, shared embeddings), each group in module order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in _named_tensors(model):
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _named_tensors(model):
    yield from model.named_parameters(remove_duplicate=False)
    persistent = set(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if name in persistent:
            yield name, buffer


def load_weights(model, source, *, strict: bool = True):
    """Copy weights into ``model`` from a state dict or a file (see :func:`read_weights`).

    A tensor shared by several names (a tied head) may appear under any of them. Raises
    :class:`HFError` naming every missing or unexpected tensor and every shape mismatch, before
    anything is copied. Returns the model.
    """
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    import torch

    state = dict(source) if isinstance(source, Mapping) else read_weights(source)
    state = {_strip_prefixes(k): v for k, v in state.items()}
    tensors = dict(_named_tensors(model))
    spec = getattr(model, "spec", None)
    rows = (spec.vocab_size, spec.padded_vocab_size) if spec is not None else None
    problems, plan = [], []
    for group in alias_groups(model):
        present = [n for n in group if n in state]
        if not present:
            problems.append(f"missing: {group[0]} (shape {tuple(tensors[group[0]].shape)})")
            continue
        value, target = state[present[0]], tensors[group[0]]
        if (
            rows
            and rows[0] != rows[1]
            and tuple(value.shape) == (rows[0], *target.shape[1:])
            and (target.shape[0] == rows[1])
        ):  # unpadded weights (a Hugging Face vocabulary) into the rows a padded vocabulary's table starts with
            target = target[: rows[0]]
        if tuple(value.shape) != tuple(target.shape):
            problems.append(
                f"{present[0]}: the weights have shape {tuple(value.shape)}, the model has {tuple(target.shape)}"
            )
            continue
        for other in present[1:]:
            if not torch.equal(state[other], value):
                problems.append(f"{other} should be the same tensor as {present[0]} (tied) but differs")
        plan.append((target, value))
    unexpected = sorted(set(state) - set(tensors))
    if strict:
        problems += [f"unexpected: {name} (shape {tuple(state[name].shape)})" for name in unexpected]
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise HFError(f"the weights do not fit the model:\n  {shown}")
    with torch.no_grad():
        for target, value in plan:
            target.copy_(value)
    return model


def unpadded(spec):
    """``spec`` without its vocabulary padding (``pad_vocab_to_multiple_of``): what a Hugging Face
    config and its weights hold."""
    return spec if spec.pad_vocab_to_multiple_of == 1 else spec.model_copy(update={"pad_vocab_to_multiple_of": 1})


def unpad_rows(spec, state: dict) -> dict:
    """``state`` (tensors of ``spec``'s model by name) with a padded vocabulary's rows cut off
    every tensor that has them (the embedding table, the output projection and its bias)."""
    if spec.pad_vocab_to_multiple_of == 1:
        return state
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    from yamlformer.builder.assemble import build_model

    padded = build_model(spec, device="meta").state_dict()
    plain = build_model(unpadded(spec), device="meta").state_dict()
    cut = {name for name, t in padded.items() if name in plain and plain[name].shape != t.shape}
    return {name: (t[: plain[name].shape[0]] if name in cut else t) for name, t in state.items()}


def _strip_prefixes(name: str) -> str:
    # torch.compile wraps modules as `_orig_mod`
    return name.replace("_orig_mod.", "")


def dedupe(state: Mapping) -> dict:
    """One entry per storage: safetensors refuses two names for one tensor; the first name wins."""
    seen: dict[tuple, str] = {}
    out = {}
    for name, tensor in state.items():
        key = (
            tensor.device.type,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        if key in seen and tensor.numel():
            continue
        seen[key] = name
        out[name] = tensor
    return out


def save_weights(source, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write a model's (or a state dict's) tensors to ``path`` as safetensors, shared ones once."""
    # local: safetensors loads to read or write weights (builder.hf serves torch-free commands)
    from safetensors.torch import save_file

    state = source.state_dict() if hasattr(source, "state_dict") else dict(source)
    state = {k: v.detach().cpu().contiguous() for k, v in dedupe(state).items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={"format": "pt", **(metadata or {})})
    return path


def _first_line(exc: Exception) -> str:
    return _cut(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, 120)
