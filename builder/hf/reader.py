"""Import: a local Hugging Face folder read as a spec, our tensors and its tokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from yamlformer.builder.hf.checks import check_config, inside, read_json
from yamlformer.builder.hf.common import Family, HFError
from yamlformer.builder.hf.families import _keys_with_value, family_of, validate
from yamlformer.builder.hf.tokenizer import read_tokenizer
from yamlformer.builder.hf.weights import Checkpoint, save_weights
from yamlformer.builder.outputs import claim_folder

#: files beside the weights that a Hugging Face folder needs to be used (tokenizer, generation)
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.spm",
)


def read_config(folder: str | Path) -> dict:
    """``folder/config.json``, read safely and with every value of its key's kind
    (:mod:`yamlformer.builder.hf.checks`); :class:`HFError` naming the file and the key otherwise."""
    path = Path(folder) / "config.json"
    if not (path.is_file() or path.is_symlink()):
        raise HFError(f"{folder} has no config.json (a Hugging Face model folder has one)")
    config = read_json(path, "config", Path(folder))
    check_config(config, path)
    return config


def _to_spec(family: Family, config: dict, names: set[str], path: str | Path) -> dict:
    """``family.to_spec`` with a value it cannot use reported as a one-line :class:`HFError`."""
    try:
        return family.to_spec(config, names)
    except HFError as exc:
        raise type(exc)(f"{path}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        raise HFError(
            f"{path}: cannot read it as a {family.model_type} config ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:120]})"
        ) from None


def config_to_spec(config: Mapping, names: set[str] = frozenset(), name: str | None = None) -> dict:
    """The spec dict of a Hugging Face ``config.json`` (validated; returned as written)."""
    check_config(config, "config.json")
    family = family_of(config)
    spec = {
        "name": name or config.get("_name_or_path") or family.model_type,
        **_to_spec(family, dict(config), set(names), "config.json"),
    }
    validate(spec, config, "config.json")
    return spec


def read_hf(folder: str | Path, name: str | None = None) -> tuple[dict, Any, dict]:
    """``(spec dict, ModelSpec, state dict)`` of a local Hugging Face folder.

    Reads only files inside ``folder`` (:mod:`yamlformer.builder.hf.checks`); every fault (a config value of
    the wrong kind, weights of other shapes than the config implies, a missing or unexpected
    tensor) is one line of :class:`HFError` naming the file, and the key or tensor.
    """
    folder = Path(folder)
    config = read_config(folder)
    config_path = folder / "config.json"
    family = family_of(config, config_path)
    checkpoint = Checkpoint(folder)
    names = checkpoint.names()
    spec_dict = {"name": name or folder.resolve().name, **_to_spec(family, config, names, config_path)}
    tied_copy = _decide_tying(family, spec_dict, checkpoint)
    spec = validate(spec_dict, config, config_path)
    links = family.links(spec)
    if family.alternative_links is not None:
        alternative = family.alternative_links(spec)
        if alternative and alternative[0].hf[0] in names:
            replaced = {o for link in alternative for o in link.ours}
            links = [link for link in links if not set(link.ours) & replaced] + alternative
    missing = [n for link in links for n in link.hf if n not in names]
    if missing:
        raise HFError(f"{folder}: the weights lack {missing[0]}, which config.json implies{_more(missing)}")
    _check_shapes(spec, links, checkpoint, config, config_path)
    state, claimed = {}, set()
    for link in links:
        tensors = [checkpoint.get(n) for n in link.hf]
        for n, tensor in zip(link.hf, tensors):
            _check_finite(checkpoint, n, tensor)
        state.update(zip(link.ours, link.to_ours(tensors)))
        claimed.update(link.hf)
    leftover = sorted(n for n in names - claimed if n != tied_copy and not family.is_ignored(n))
    if leftover:
        raise HFError(
            f"{folder}: the weights hold {leftover[0]}, which is not part of a {family.model_type} model "
            f"as config.json configures it{_more(leftover)}"
        )
    return _clean(spec_dict), spec, state


def _check_finite(checkpoint: Checkpoint, name: str, tensor) -> None:
    """A weight holding NaN or infinite values (a damaged file, a diverged run) is refused, naming
    the tensor and how much of it is bad: a model built from it computes nothing."""
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    import torch

    if not tensor.is_floating_point():
        return
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    bad = int(finite.numel() - finite.sum())
    nan = int(torch.isnan(tensor).sum())
    kinds = " and ".join(k for k, n in (("NaN", nan), ("infinite", bad - nan)) if n)
    raise HFError(
        f"{checkpoint.file(name)}: tensor {name} holds {bad:,} {kinds} values (of {tensor.numel():,}): "
        "damaged or diverged weights; not imported"
    )


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def _check_shapes(spec, links, checkpoint: Checkpoint, config: Mapping, config_path: Path) -> None:
    """Each checkpoint tensor has the shape config.json implies, found by running each link's
    conversion on meta tensors of our model's shapes; the first that differs, named with the
    config keys whose value it disagrees with, is a one-line :class:`HFError`."""
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    import torch

    from yamlformer.builder.assemble import build_model

    ours = {k: v.shape for k, v in build_model(spec, device="meta").state_dict().items()}
    wrong = []
    for link in links:
        if not all(o in ours for o in link.ours):
            continue
        expected = link.to_hf([torch.empty(ours[o], device="meta") for o in link.ours])
        for name, want in zip(link.hf, expected):
            got = checkpoint.shape(name)
            if tuple(got) != tuple(want.shape):
                wrong.append((name, tuple(got), tuple(want.shape)))
    if not wrong:
        return
    name, got, want = wrong[0]
    differing = {w for g, w in zip(got, want) if g != w} if len(got) == len(want) else set()
    keys = sorted({k for w in differing for k in _keys_with_value(config, w)})
    because = f" ({', '.join(f'{k} = {config[k]}' for k in keys)})" if keys else ""
    raise HFError(
        f"{config_path}: does not match the weights: {name} has shape {got} in {checkpoint.file(name).name}; "
        f"the config implies {want}{because}{_more(wrong)}"
    )


def _decide_tying(family: Family, spec_dict: dict, checkpoint: Checkpoint) -> str | None:
    """Untie where the checkpoint holds a head that differs from the embedding (transformers 5.x
    does the same); returns the head's name when it is a copy to skip."""
    if not family.tied or not spec_dict.get("tie_embeddings"):
        return None
    head, *embeddings = family.tied
    embedding = next((n for n in embeddings if n in checkpoint), None)
    if head not in checkpoint or embedding is None:
        return head
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    import torch

    if torch.equal(checkpoint.get(head), checkpoint.get(embedding)):
        return head
    spec_dict["tie_embeddings"] = False
    return None


def _clean(value: Any, in_override: bool = False) -> Any:
    """Drop nulls and empty lists from a spec dict (the defaults say the same), except inside
    overrides, where a null replaces the stack's value."""
    if isinstance(value, dict):
        return {
            k: _clean(v, in_override or k == "overrides")
            for k, v in value.items()
            if in_override or not (v is None or v == [])
        }
    if isinstance(value, list):
        return [_clean(v, in_override) for v in value]
    return value


def from_hf(folder: str | Path, name: str | None = None) -> tuple[Any, dict]:
    """``(spec, state_dict)``: the validated ``ModelSpec`` of a local Hugging Face folder and its
    tensors under our names, ready for ``load_weights(build_model(spec), state_dict)``."""
    _, spec, state = read_hf(folder, name)
    return spec, state


#: what ``import_hf`` writes into its output folder (an earlier import's files are these)
IMPORT_FILES = ("spec.yaml", "model.safetensors", "hf_config.json", *SIDE_FILES)


def import_hf(
    folder: str | Path, out: str | Path, name: str | None = None, overwrite: bool = False
) -> tuple[Path, Path]:
    """Write ``out/spec.yaml`` and ``out/model.safetensors``, the original config as
    ``hf_config.json`` and the folder's tokenizer and generation files (for ``builder generate
    OUT`` and for export); returns the two paths. The tokenizer is checked to load first
    (:func:`yamlformer.builder.hf.tokenizer.read_tokenizer`). ``out`` is never ``folder`` (nor a
    file there); an earlier import in ``out`` is replaced only with ``overwrite`` (its tokenizer
    files removed), else :class:`yamlformer.builder.outputs.OutputError` (:mod:`yamlformer.builder.outputs`)."""
    folder, out = Path(folder), Path(out)
    read_config(folder)  # a folder that is no Hugging Face model is named first (a cheap read)
    claim_folder(out, IMPORT_FILES, [folder], overwrite)  # before any weights are read
    spec_dict, _, state = read_hf(folder, name)
    return write_import(folder, out, spec_dict, state)


def write_import(folder: Path, out: str | Path, spec_dict: dict, state: dict) -> tuple[Path, Path]:
    """:func:`import_hf`'s output of ``spec_dict`` and ``state`` read from the Hugging Face ``folder``
    (a PEFT import: its base's, the adapters among them), ``out`` claimed already."""

    out = Path(out)
    read_tokenizer(folder)  # a tokenizer that does not load fails the import, not a later run
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if any(stale.match(pattern) for pattern in SIDE_FILES) and (stale.is_file() or stale.is_symlink()):
            stale.unlink()
    config = read_config(folder)
    spec_path = out / "spec.yaml"
    header = (
        f"# Imported by `builder import-hf` from a Hugging Face {config['model_type']} model "
        f"({folder.resolve().name}).\n# Weights: model.safetensors beside this file "
        "(yamlformer.builder.hf.load_weights).\n"
    )
    spec_path.write_text(header + yaml.safe_dump(spec_dict, sort_keys=False))
    weights_path = save_weights(state, out / "model.safetensors", metadata={"source": "hf:" + config["model_type"]})
    (out / "hf_config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_side_files(folder, out)
    return spec_path, weights_path


def _copy_side_files(src: Path, dst: Path) -> None:
    for pattern in SIDE_FILES:
        for path in src.glob(pattern):
            if inside(src, path).is_file():
                shutil.copy2(path, dst / path.name)
