"""Hugging Face interoperability: read a local model folder as a spec and weights, write one back.

```python
from builder import build_model
from builder.hf import from_hf, to_hf, load_weights

spec, state_dict = from_hf("path/to/hf-model")   # a validated ModelSpec; tensors under our names
model = load_weights(build_model(spec), state_dict)   # or load_weights(model, "out/model.safetensors")
to_hf(spec, model, "path/to/export")             # config.json + model.safetensors; returns the family
```

Only local files are read (``config.json`` and ``*.safetensors``, sharded or not, or
``pytorch_model.bin`` through ``torch.load(weights_only=True)``); nothing is downloaded and
``transformers`` is never imported. A folder is not trusted (:mod:`builder.hf.checks`): no path
that leads out of it is opened, JSON is read with size and depth limits, every ``config.json``
value must be of its key's kind, and each fault is one line of :class:`HFError` naming the file
and the key or tensor. Every family is a table in :mod:`builder.hf.decoders` or
:mod:`builder.hf.encoders`; the spec it produces states every difference as a field.

Export picks the family whose config expresses the spec exactly: it writes the config, reads it
back as a spec and compares layer by layer (dropout rates aside, which inference never sees);
the first difference is the reason a family does not fit.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from builder.hf import decoders, encoders
from builder.hf.common import Family, HFError, Unsupported
from builder.hf.checks import check_config, inside, read_json
from builder.hf.weights import (
    Checkpoint,
    alias_groups,
    dedupe,
    load_weights,
    read_weights,
    save_weights,
    torch_load_safely,
)

__all__ = [
    "FAMILIES",
    "HFError",
    "Unsupported",
    "choose_family",
    "config_to_spec",
    "from_hf",
    "load_weights",
    "read_hf",
    "read_weights",
    "save_weights",
    "supported_families",
    "to_hf",
]

FAMILIES: dict[str, Family] = {f.model_type: f for f in decoders.FAMILIES + encoders.FAMILIES}

#: files beside the weights that a Hugging Face folder needs to be used (tokenizer, generation)
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.spm",
)
#: config.json keys that are not architecture and travel unchanged through import and export
TOKEN_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "forced_eos_token_id",
)


def supported_families() -> str:
    return "\n".join(f"  {name:8} {family.description}" for name, family in FAMILIES.items())


def family_of(config: Mapping, path: str | Path = "config.json") -> Family:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        shown = repr(model_type) if isinstance(model_type, str) and len(model_type) <= 40 else "(absent or not a name)"
        raise Unsupported(
            f"{path}: model_type {shown} is not supported; supported families:\n{supported_families()}"
        )
    return FAMILIES[model_type]


def read_config(folder: str | Path) -> dict:
    """``folder/config.json``, read safely and with every value of its key's kind
    (:mod:`builder.hf.checks`); :class:`HFError` naming the file and the key otherwise."""
    path = Path(folder) / "config.json"
    if not (path.is_file() or path.is_symlink()):
        raise HFError(f"{folder} has no config.json (a Hugging Face model folder has one)")
    config = read_json(path, "config", Path(folder))
    check_config(config, path)
    return config


def validate(spec_dict: Mapping, config: Mapping | None = None, source: str | Path = "the converted spec"):
    """The validated ``ModelSpec`` of a spec dict, or a one-line :class:`HFError`: the first
    problem, named by the ``config`` key that gave the value when one did."""
    from pydantic import ValidationError

    from builder.schema import SpecRuleError, spec_model

    try:
        return spec_model().model_validate(dict(spec_dict))
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        field = ".".join(map(str, first["loc"]))
        keys = _keys_with_value(config or {}, first.get("input"))
        where = f"{' or '.join(keys)} (the spec's {field})" if keys else field
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise HFError(f"{source}: {where}: {first['msg']}{more}") from None
    except SpecRuleError as exc:
        raise HFError(f"{source}: {' '.join(str(exc).split())}") from None


def _keys_with_value(config: Mapping, value: Any) -> list[str]:
    """The config keys holding ``value`` (same type; booleans apart): who set a bad field."""
    if value is None or isinstance(value, (dict, list)):
        return []
    return [k for k, v in config.items() if type(v) is type(value) and v == value]


def _to_spec(family: Family, config: dict, names: set[str], path: str | Path) -> dict:
    """``family.to_spec`` with a value it cannot use reported as a one-line :class:`HFError`."""
    try:
        return family.to_spec(config, names)
    except HFError as exc:
        raise type(exc)(f"{path}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        raise HFError(f"{path}: cannot read it as a {family.model_type} config ({type(exc).__name__}: "
                      f"{' '.join(str(exc).split())[:120]})") from None


def config_to_spec(config: Mapping, names: set[str] = frozenset(), name: str | None = None) -> dict:
    """The spec dict of a Hugging Face ``config.json`` (validated; returned as written)."""
    check_config(config, "config.json")
    family = family_of(config)
    spec = {"name": name or config.get("_name_or_path") or family.model_type,
            **_to_spec(family, dict(config), set(names), "config.json")}
    validate(spec, config, "config.json")
    return spec


def read_hf(folder: str | Path, name: str | None = None) -> tuple[dict, Any, dict]:
    """``(spec dict, ModelSpec, state dict)`` of a local Hugging Face folder.

    Reads only files inside ``folder`` (:mod:`builder.hf.checks`); every fault (a config value of
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
        state.update(zip(link.ours, link.to_ours([checkpoint.get(n) for n in link.hf])))
        claimed.update(link.hf)
    leftover = sorted(n for n in names - claimed if n != tied_copy and not family.is_ignored(n))
    if leftover:
        raise HFError(
            f"{folder}: the weights hold {leftover[0]}, which is not part of a {family.model_type} model "
            f"as config.json configures it{_more(leftover)}"
        )
    return _clean(spec_dict), spec, state


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def _check_shapes(spec, links, checkpoint: Checkpoint, config: Mapping, config_path: Path) -> None:
    """Each checkpoint tensor has the shape config.json implies, found by running each link's
    conversion on meta tensors of our model's shapes; the first that differs, named with the
    config keys whose value it disagrees with, is a one-line :class:`HFError`."""
    import torch

    from builder.assemble import build_model

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


def import_hf(folder: str | Path, out: str | Path, name: str | None = None) -> tuple[Path, Path]:
    """Write ``out/spec.yaml`` and ``out/model.safetensors`` (and the original config and tokenizer
    files, for export); returns the two paths."""
    import yaml

    folder, out = Path(folder), Path(out)
    spec_dict, _, state = read_hf(folder, name)
    out.mkdir(parents=True, exist_ok=True)
    config = read_config(folder)
    spec_path = out / "spec.yaml"
    header = (
        f"# Imported by `builder import-hf` from a Hugging Face {config['model_type']} model "
        f"({folder.resolve().name}).\n# Weights: model.safetensors beside this file "
        "(builder.hf.load_weights).\n"
    )
    spec_path.write_text(header + yaml.safe_dump(spec_dict, sort_keys=False))
    weights_path = save_weights(state, out / "model.safetensors", metadata={"source": "hf:" + config["model_type"]})
    (out / "hf_config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_side_files(folder, out)
    return spec_path, weights_path


def _copy_side_files(src: Path, dst: Path) -> None:
    for pattern in SIDE_FILES:
        for path in src.glob(pattern):
            if not (dst / path.name).exists() and inside(src, path).is_file():
                shutil.copy2(path, dst / path.name)


# --- export ------------------------------------------------------------------------------


def _semantic(spec) -> dict:
    """What a spec means, layer by layer, defaults resolved and dropout rates left out."""
    d = spec.d_model
    data = spec.model_dump(mode="json", exclude={"name", "extends", "encoder", "decoder"})
    if data["position"]["type"] == "learned":
        data["position"]["max_positions"] = data["position"]["max_positions"] or spec.max_seq_len
    if spec.architecture != "encoder-decoder":
        data.pop("share_encoder_decoder_embeddings")

    def block(config) -> dict:
        out = config.model_dump(mode="json")
        if "n_kv_heads" in out:
            out["head_dim"] = config.resolved_head_dim(d)
        if "hidden_dim" in out:
            out["hidden_dim"] = config.resolved_hidden_dim(d)
        if "expert" in out:
            out["expert"] = block(config.expert)
        return out

    cross = spec.architecture == "encoder-decoder"
    for name, stack in spec.stacks().items():
        layers = []
        for i in range(stack.n_layers):
            layer = stack.layer(i)
            entry = {"attention": block(layer.attention), "ffn": block(layer.ffn), "norm": block(layer.norm)}
            if cross and name == "decoder":
                entry["cross_attention"] = block(layer.cross_attention)
            layers.append(entry)
        data[name] = {"n_layers": stack.n_layers, "final_norm": stack.final_norm, "layers": layers}
    return _without_dropout(data)


def _without_dropout(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_dropout(v) for k, v in value.items() if k != "dropout"}
    if isinstance(value, list):
        return [_without_dropout(v) for v in value]
    return value


def _differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for key in list(ours) + [k for k in theirs if k not in ours]:
            out += _differences(ours.get(key), theirs.get(key), f"{path}.{key}" if path else str(key))
        return out
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in _differences(a, b, f"{path}[{i}]")]
    return [] if ours == theirs else [f"{path} is {ours!r} in the spec; {{family}} would make it {theirs!r}"]


def fit(family: Family, spec) -> tuple[dict | None, list[str]]:
    """``(config, [])`` when ``family`` expresses ``spec`` exactly, else ``(None, reasons)``."""
    try:
        config = family.to_config(spec)
        back = validate({"name": spec.name, **family.to_spec(config, set())})
    except (Unsupported, HFError, TypeError, KeyError, AttributeError) as exc:
        return None, [str(exc) or type(exc).__name__]
    diffs = _differences(_semantic(spec), _semantic(back))
    return (None, [d.replace("{family}", family.model_type) for d in diffs]) if diffs else (config, [])


def choose_family(spec, family: str | None = None) -> tuple[Family, dict]:
    """The family (``family`` if given, else the first that fits) and its config for ``spec``."""
    if family is not None:
        if family not in FAMILIES:
            raise Unsupported(f"no family {family!r}; supported families:\n{supported_families()}")
        candidates = [FAMILIES[family]]
    else:
        candidates = list(FAMILIES.values())
    reasons = []
    for candidate in candidates:
        if spec.architecture != _architecture(candidate):
            reasons.append(f"  {candidate.model_type}: is {_architecture(candidate)}, the spec is {spec.architecture}")
            continue
        config, why = fit(candidate, spec)
        if config is not None:
            return candidate, config
        more = f" (and {len(why) - 1} more)" if len(why) > 1 else ""
        first = " ".join(why[0].split())  # one line per family
        reasons.append(f"  {candidate.model_type}: {first}{more}")
    raise Unsupported(
        f"no Hugging Face family expresses spec {spec.name!r} exactly:\n" + "\n".join(reasons)
    )


def _architecture(family: Family) -> str:
    return {"AutoModelForCausalLM": "decoder-only", "AutoModelForMaskedLM": "encoder-only"}.get(
        family.auto_class, "encoder-decoder"
    )


def to_hf(spec, weights, folder: str | Path, *, family: str | None = None,
          extra_config: Mapping[str, Any] | None = None) -> Family:
    """Write ``folder/config.json`` and ``folder/model.safetensors`` for ``spec`` and ``weights``
    (a model, a state dict, or a weights file), loadable by ``transformers``' Auto class.

    ``extra_config`` adds non-architecture keys (token ids). Raises :class:`Unsupported` naming,
    for each family, what it cannot express.
    """
    chosen, config = choose_family(spec, family)
    lacking = [k for k in chosen.needs if k not in (extra_config or {})]
    if lacking:
        raise HFError(
            f"a {chosen.model_type} config needs {', '.join(lacking)}, which a spec does not hold; "
            "pass them (export-hf --hf-config KEY=VALUE, or extra_config=)"
        )
    state = _our_state(spec, weights)
    tensors = {}
    for link in chosen.links(spec):
        missing = [n for n in link.ours if n not in state]
        if missing:
            raise HFError(f"the weights have no {missing[0]}")
        tensors.update(zip(link.hf, link.to_hf([state[n] for n in link.ours])))
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    config = {
        "model_type": chosen.model_type,
        "architectures": [chosen.hf_class],
        **config,
        **{k: v for k, v in (extra_config or {}).items() if k in TOKEN_KEYS or k not in config},
    }
    if len(dtypes) == 1:
        config["dtype"] = dtypes.pop()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return chosen


def _our_state(spec, weights) -> dict:
    """Our tensors by every name they have (aliases of a shared tensor resolved)."""
    if hasattr(weights, "state_dict"):
        state = weights.state_dict()
    elif isinstance(weights, Mapping):
        state = dict(weights)
    else:
        state = read_weights(weights)
    state = {re.sub(r"^(model\.)?(_orig_mod\.)?", "", k): v for k, v in state.items()}
    from builder.assemble import build_model

    for group in alias_groups(build_model(spec, device="meta")):
        present = next((n for n in group if n in state), None)
        if present is not None:
            for name in group:
                state.setdefault(name, state[present])
    return state


def export_hf(source: str | Path, out: str | Path, *, spec=None, weights: str | Path | None = None,
              family: str | None = None, extra_config: Mapping[str, Any] | None = None) -> Family:
    """``builder export-hf``: a spec file with its weights (``model.safetensors`` beside it unless
    ``weights`` says otherwise) or a ``builder train`` checkpoint (``.ckpt``), written as a
    Hugging Face folder. ``spec``: the spec already loaded (with ``--set`` overrides). Token ids
    come from ``hf_config.json`` beside the source (written by import) and ``extra_config``."""
    source, out = Path(source), Path(out)
    side = source.parent
    if source.suffix in (".ckpt", ".pt", ".pth"):
        ckpt_spec, state, _ = _read_training_checkpoint(source)
        spec = spec or ckpt_spec
    else:
        if spec is None:
            from builder.loader import load_spec

            spec = load_spec(source)
        state = read_weights(Path(weights) if weights else side / "model.safetensors")
    extra: dict[str, Any] = {}
    hf_config = side / "hf_config.json"
    if hf_config.is_file():
        extra = {k: v for k, v in read_json(hf_config).items() if k in TOKEN_KEYS and v is not None}
    extra.update(extra_config or {})
    chosen = to_hf(spec, state, out, family=family, extra_config=extra)
    _copy_side_files(side, out)
    return chosen


def _read_training_checkpoint(path: Path):
    checkpoint = torch_load_safely(path)
    meta = checkpoint.get("builder") if isinstance(checkpoint, Mapping) else None
    if not isinstance(meta, Mapping) or "spec" not in meta or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise HFError(f"{path} was not written by `builder train` (it holds no spec)")
    spec = validate(meta["spec"], source=path)
    state = {k.removeprefix("model.").replace("_orig_mod.", ""): v for k, v in checkpoint["state_dict"].items()}
    return spec, dedupe(state), meta
