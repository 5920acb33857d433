"""Export: a spec and its weights (and tokenizer) written as a Hugging Face folder, in the first
family whose config expresses the spec exactly."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from builder.checkpoints import looks_like_checkpoint
from builder.hf.checks import read_json
from builder.hf.common import Family, HFError, Unsupported
from builder.hf.families import FAMILIES, TOKEN_KEYS, supported_families, validate
from builder.hf.reader import _copy_side_files
from builder.hf.tokenizer import generation_config, to_tokenizers, token_ids, write_tokenizer
from builder.hf.weights import alias_groups, dedupe, read_weights


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


def export_line(spec) -> str:
    """Which Hugging Face family ``builder export-hf`` would write ``spec`` as, or why none can:
    said before training (describe, ``train --dry-run``), not found out after it."""
    try:
        chosen, _ = choose_family(spec)
    except Unsupported as exc:
        import re

        same = [line.strip() for line in str(exc).splitlines()[1:] if "the spec is" not in line]  # its architecture's
        if not same:
            return f"none: no Hugging Face family is {spec.architecture}"

        def differences(line: str) -> int:
            more = re.search(r"\(and (\d+) more\)$", line)
            return 1 + (int(more.group(1)) if more else 0)

        return f"none: no Hugging Face family expresses it exactly (closest, {min(same, key=differences)})"
    return f"Hugging Face {chosen.model_type} ({chosen.hf_class}), by builder export-hf"


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
    raise Unsupported(f"no Hugging Face family expresses spec {spec.name!r} exactly:\n" + "\n".join(reasons))


def _architecture(family: Family) -> str:
    return {"AutoModelForCausalLM": "decoder-only", "AutoModelForMaskedLM": "encoder-only"}.get(
        family.auto_class, "encoder-decoder"
    )


def to_hf(
    spec,
    weights,
    folder: str | Path,
    *,
    family: str | None = None,
    extra_config: Mapping[str, Any] | None = None,
    tokenizer: Mapping | None = None,
    generation: bool = True,
) -> Family:
    """Write ``folder/config.json`` and ``folder/model.safetensors`` for ``spec`` and ``weights``
    (a model, a state dict, or a weights file), loadable by ``transformers``' Auto class.

    ``tokenizer``: a tokenizer state (:mod:`builder.hf.tokenizer`; what ``builder train`` keeps in
    its checkpoints), written as ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json``; its special tokens' ids go into the config.
    ``generation``: also write ``generation_config.json`` (token ids, ``max_length`` = the spec's
    ``max_seq_len``; greedy) for a generating family. ``extra_config`` adds or overrides
    non-architecture keys (token ids). Raises :class:`Unsupported` naming, for each family, what
    it cannot express.
    """
    chosen, config = choose_family(spec, family)
    extra_config = {**_tokenizer_ids(spec, tokenizer), **(extra_config or {})}
    lacking = [k for k in chosen.needs if k not in extra_config]
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

    from builder.checkpoints import user_mode

    target = folder / "model.safetensors"
    tmp = folder / f".model.safetensors.tmp-{os.getpid()}"  # a failed write leaves no partial file
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        user_mode(tmp)
        os.replace(tmp, target)
    except Exception as exc:
        from builder.checkpoints import write_reason

        tmp.unlink(missing_ok=True)
        raise HFError(f"cannot write {target}: {write_reason(exc)}") from None
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        write_tokenizer(tokenizer, folder, spec.max_seq_len, append_eos=spec.architecture == "encoder-decoder")
    if generation and _architecture(chosen) != "encoder-only":
        gen = generation_config(config)
        (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return chosen


def _tokenizer_ids(spec, tokenizer: Mapping | None) -> dict:
    """The config token ids of a tokenizer state, checked against the spec's vocabulary; an
    encoder-decoder's decoder starts from bos, as the translation recipe trains it."""
    if tokenizer is None:
        return {}
    size = to_tokenizers(dict(tokenizer)).get_vocab_size(with_added_tokens=True)
    if size > spec.vocab_size:
        raise HFError(f"the tokenizer has {size:,} tokens but the model's vocab_size is {spec.vocab_size:,}")
    ids = token_ids(dict(tokenizer))
    if spec.architecture == "encoder-decoder" and "bos_token_id" in ids:
        ids["decoder_start_token_id"] = ids["bos_token_id"]
    return ids


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

    model = build_model(spec, device="meta")
    for group in alias_groups(model):
        present = next((n for n in group if n in state), None)
        if present is not None:
            for name in group:
                state.setdefault(name, state[present])
    for name, tensor in model.state_dict().items():  # weights of another model never go out silently
        if name in state and getattr(state[name], "shape", None) != tensor.shape:
            found = list(state[name].shape) if hasattr(state[name], "shape") else type(state[name]).__name__
            raise HFError(f"the weights' {name} has shape {found}, the spec makes {list(tensor.shape)}")
    return state


def export_hf(
    source: str | Path,
    out: str | Path,
    *,
    spec=None,
    weights: str | Path | None = None,
    family: str | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> Family:
    """``builder export-hf``: a spec file with its weights (``model.safetensors`` beside it unless
    ``weights`` says otherwise) or a ``builder train`` checkpoint (``.ckpt``), written as a
    Hugging Face folder. ``spec``: the spec already loaded (with ``--set`` overrides). Token ids
    come from the checkpoint's tokenizer, or ``hf_config.json`` beside the source (written by
    import), then ``extra_config``. A checkpoint's tokenizer is written with the model; the
    tokenizer and generation files beside a spec (an import's) are copied."""
    source, out = Path(source), Path(out)
    side = source.parent
    tokenizer = None
    if looks_like_checkpoint(source):
        ckpt_spec, state, meta = _read_training_checkpoint(source)
        spec = spec or ckpt_spec
        tokenizer = meta.get("tokenizer")
    else:
        if spec is None:
            from builder.spec.loader import load_spec

            spec = load_spec(source)
        state = read_weights(Path(weights) if weights else side / "model.safetensors")
    extra: dict[str, Any] = {}
    hf_config = side / "hf_config.json"
    if hf_config.is_file():
        extra = {k: v for k, v in read_json(hf_config).items() if k in TOKEN_KEYS and v is not None}
    extra.update(extra_config or {})
    generation = tokenizer is not None or not (side / "generation_config.json").is_file()
    chosen = to_hf(spec, state, out, family=family, extra_config=extra, tokenizer=tokenizer, generation=generation)
    if tokenizer is None:
        _copy_side_files(side, out)
    return chosen


def _read_training_checkpoint(path: Path):
    """The spec, the model's whole tensors and the ``builder`` metadata of a ``builder train``
    checkpoint: one file or a sharded folder, read safely and verified against its checksums
    (``builder.checkpoints``)."""
    from builder.checkpoints import CheckpointError, model_weights, read_meta
    from builder.checkpoints import read_weights as read_checkpoint

    try:
        meta = read_meta(path, check=False)["builder"]  # read_checkpoint below verifies it whole
        if "spec" not in meta:
            raise CheckpointError(f"{path} was not written by `builder train` (it holds no spec)")
        tokenizer = meta.get("tokenizer")
        if tokenizer is not None and (
            not isinstance(tokenizer, Mapping) or tokenizer.get("type") not in ("char", "sentencepiece", "tokenizers")
        ):
            raise CheckpointError(f"{path}: its tokenizer record is none of char, sentencepiece, tokenizers")
        spec = validate(meta["spec"], source=path)
        state = model_weights(read_checkpoint(path))
    except CheckpointError as exc:
        raise HFError(str(exc)) from None
    return spec, dedupe(state), meta
