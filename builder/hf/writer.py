"""Export: a spec and its weights (and tokenizer) written as a Hugging Face folder, in the first
family whose config expresses the spec exactly.

Exactly: the family's config, read back as a spec, means what the spec means layer by layer
(dropout rates aside). A family whose layers have biases also expresses a spec without them, by
writing zeros (the same function; that folder imports back with zero biases): a strict fit
anywhere wins over such a one. A spec no family expresses is refused, before any weights are read
or written, in one line naming the nearest family (the fewest differences) and its first one.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yamlformer.builder.adapters import adapted
from yamlformer.builder.checkpoints import CheckpointError, looks_like_checkpoint, model_weights, read_meta, user_mode
from yamlformer.builder.checkpoints import read_weights as read_checkpoint
from yamlformer.builder.hf.checks import read_json
from yamlformer.builder.hf.common import Family, HFError, Unsupported
from yamlformer.builder.hf.families import FAMILIES, TOKEN_KEYS, supported_families, validate
from yamlformer.builder.hf.peft import CONFIG, WEIGHTS, dense, merged, to_peft
from yamlformer.builder.hf.reader import SIDE_FILES, _copy_side_files
from yamlformer.builder.hf.tokenizer import generation_config, to_tokenizers, token_ids, write_tokenizer
from yamlformer.builder.hf.weights import alias_groups, dedupe, read_weights, unpad_rows, unpadded
from yamlformer.builder.outputs import claim_folder
from yamlformer.builder.spec.loader import load_spec

#: spec fields saying a bias tensor exists: a family that has the tensor writes zeros for a spec
#: that has none (fit's ``zero_biases``)
BIAS_FIELDS = ("bias", "qkv_bias", "out_bias")
#: config.json keys naming a classifier's classes: a checkpoint's labels replace the defaults
LABEL_KEYS = ("id2label", "label2id")
#: what ``export_hf`` writes into its output folder (an earlier export's files are these)
EXPORT_FILES = ("config.json", "model.safetensors", *SIDE_FILES)


def _semantic(spec) -> dict:
    """What a spec means, layer by layer, defaults resolved and dropout rates left out."""
    d = spec.d_model
    data = spec.model_dump(mode="json", exclude={"name", "extends", "encoder", "decoder", "adapters"})
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


def _differences(ours: Any, theirs: Any, path: str = "", zero_biases: bool = False) -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for key in list(ours) + [k for k in theirs if k not in ours]:
            out += _differences(ours.get(key), theirs.get(key), f"{path}.{key}" if path else str(key), zero_biases)
        return out
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [
            d for i, (a, b) in enumerate(zip(ours, theirs)) for d in _differences(a, b, f"{path}[{i}]", zero_biases)
        ]
    if zero_biases and ours is False and theirs is True and path.rsplit(".", 1)[-1] in BIAS_FIELDS:
        return []  # written as zeros
    return [] if ours == theirs else [f"{path} is {ours!r} in the spec; {{family}} would make it {theirs!r}"]


def fit(family: Family, spec, zero_biases: bool = False) -> tuple[dict | None, list[str]]:
    """``(config, [])`` when ``family`` expresses ``spec`` exactly (``zero_biases``: with zeros for
    the biases the spec has not), else ``(None, reasons)``: every difference, or the one thing
    its config cannot say."""
    try:
        config = family.to_config(spec)
        back = validate({"name": spec.name, **family.to_spec(config, set())})
    except (Unsupported, HFError, TypeError, KeyError, AttributeError) as exc:
        return None, [str(exc) or type(exc).__name__]
    diffs = _differences(_semantic(spec), _semantic(back), zero_biases=zero_biases)
    return (None, [d.replace("{family}", family.model_type) for d in diffs]) if diffs else (config, [])


class NoFamily(Unsupported):
    """No family expresses the spec: ``nearest`` is the family with the fewest differences (None
    when no family has the spec's architecture) and ``reasons`` its differences."""

    def __init__(self, message: str, nearest: str | None, reasons: list[str]):
        super().__init__(message)
        self.nearest, self.reasons = nearest, reasons


def export_line(spec) -> str:
    """Which Hugging Face family ``builder export-hf`` would write ``spec`` as, or why none can:
    said before training (describe, ``train --dry-run``, ``list``), not found out after it."""
    try:
        chosen, _ = choose_family(spec)
    except NoFamily as exc:
        if exc.nearest is None:
            return f"none: no Hugging Face family is {spec.architecture}"
        return f"none: no Hugging Face family expresses it exactly (closest, {exc.nearest}: {_first(exc.reasons)})"
    line = f"Hugging Face {chosen.model_type} ({chosen.classes(spec)[0]}), by builder export-hf"
    if spec.adapters is not None:
        line += " --merge (adapters folded in), or the adapters alone for PEFT by --adapters-only"
    return line


def _first(reasons: list[str]) -> str:
    more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
    return " ".join(reasons[0].split()) + more


def choose_family(spec, family: str | None = None) -> tuple[Family, dict]:
    """The family (``family`` if given, else the first that expresses ``spec`` exactly, else the
    first that does with zero biases) and its config; else :class:`NoFamily`, one line."""
    if family is not None:
        if family not in FAMILIES:
            raise Unsupported(f"no family {family!r}; supported families:\n{supported_families()}")
        candidates = [FAMILIES[family]]
    else:
        candidates = list(FAMILIES.values())
    candidates = [c for c in candidates if _architecture(c) == spec.architecture]
    if not candidates:
        named = f"{family} is {_architecture(FAMILIES[family])}" if family else f"no family is {spec.architecture}"
        raise NoFamily(f"spec {spec.name!r} is {spec.architecture}; {named}", None, [])
    misses: list[tuple[Family, list[str]]] = []
    for zero_biases in (False, True):
        misses = []
        for candidate in candidates:
            config, why = fit(candidate, spec, zero_biases)
            if config is not None:
                return candidate, config
            misses.append((candidate, why))
    # nearest: the fewest differences; a config that cannot be written at all counts as farthest
    nearest, reasons = min(misses, key=lambda miss: (_cannot_write(miss[1]), len(miss[1])))
    if family:
        message = f"family {family!r} does not express spec {spec.name!r} exactly: {_first(reasons)}"
    else:
        message = (
            f"no Hugging Face family expresses spec {spec.name!r} exactly; "
            f"nearest, {nearest.model_type}: {_first(reasons)}"
        )
    raise NoFamily(message, nearest.model_type, reasons)


def _cannot_write(reasons: list[str]) -> bool:
    """Whether ``reasons`` is a config that could not be written (no field-by-field difference)."""
    return not (reasons and " in the spec; " in reasons[0])


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

    ``tokenizer``: a tokenizer state (:mod:`yamlformer.builder.hf.tokenizer`; what ``builder train`` keeps in
    its checkpoints), written as ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json``; its special tokens' ids go into the config.
    ``generation``: also write ``generation_config.json`` (token ids, ``max_length`` = the spec's
    ``max_seq_len``; greedy) for a generating family. ``extra_config`` adds or overrides
    non-architecture keys (token ids). Raises :class:`Unsupported` naming, for each family, what
    it cannot express.
    """
    chosen, config, tensors, (hf_class, auto_class) = hf_tensors(spec, weights, family, extra_config, tokenizer)
    spec = unpadded(spec)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # local: safetensors loads to read or write weights (builder.hf serves torch-free commands)
    from safetensors.torch import save_file

    target = folder / "model.safetensors"
    tmp = folder / f".model.safetensors.tmp-{os.getpid()}"  # a failed write leaves no partial file
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        user_mode(tmp)
        os.replace(tmp, target)
    except Exception as exc:
        # local: builder.checkpoints loads only to name a failed write
        from yamlformer.builder.checkpoints import write_reason

        tmp.unlink(missing_ok=True)
        raise HFError(f"cannot write {target}: {write_reason(exc)}") from None
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        write_tokenizer(tokenizer, folder, spec.max_seq_len, spec.architecture, chosen.start_from_pad)
    if generation and _architecture(chosen) != "encoder-only":
        gen = generation_config(config)
        (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    written = copy.copy(chosen)  # the family as this spec's classes name it (a head of several)
    written.hf_class, written.auto_class = hf_class, auto_class
    return written


def hf_tensors(
    spec, weights, family: str | None = None, extra_config: Mapping[str, Any] | None = None, tokenizer=None
) -> tuple[Family, dict, dict, tuple[str, str]]:
    """What :func:`to_hf` writes, in memory: the family, its ``config.json`` dict, the tensors under
    its names and its ``(class, Auto class)``; the vocabulary unpadded (``builder export-gguf``
    starts from these too)."""
    chosen, config = choose_family(unpadded(spec), family)  # Hugging Face holds the vocabulary unpadded
    extra_config = {**_tokenizer_ids(spec, tokenizer, chosen), **(extra_config or {})}
    lacking = [k for k in chosen.needs if k not in extra_config]
    if lacking:
        raise HFError(
            f"a {chosen.model_type} config needs {', '.join(lacking)}, which a spec does not hold; "
            "pass them (export-hf --hf-config KEY=VALUE, or extra_config=)"
        )
    state, expected = _our_state(spec, weights)
    state, spec = unpad_rows(spec, state), unpadded(spec)
    tensors = {}
    for link in chosen.links(spec):
        ours = [state[n] if n in state else _zero_bias(n, state, expected) for n in link.ours]
        tensors.update(zip(link.hf, link.to_hf(ours)))
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    like = next(iter(tensors.values()))
    tensors.update({k: v.to(like.dtype) for k, v in chosen.computed(spec).items()})
    hf_class, auto_class = chosen.classes(spec)
    config = {
        "model_type": chosen.model_type,
        **config,
        "architectures": [hf_class],
        **{k: v for k, v in (extra_config or {}).items() if k in TOKEN_KEYS + LABEL_KEYS or k not in config},
    }
    if len(dtypes) == 1:
        config["dtype"] = dtypes.pop()
    return chosen, config, tensors, (hf_class, auto_class)


def _zero_bias(name: str, state: dict, expected: set[str]):
    """Zeros for a bias the spec has not (not among the model's ``expected`` tensors) and the
    family has (see the module docstring), shaped as its weight's first dimension; any other
    missing tensor is an :class:`HFError`."""
    weight = state.get(name.removesuffix(".bias") + ".weight")
    if name in expected or not name.endswith(".bias") or weight is None:
        raise HFError(f"the weights have no {name}")
    return weight.new_zeros(weight.shape[0])


def _tokenizer_ids(spec, tokenizer: Mapping | None, family: Family) -> dict:
    """The config token ids of a tokenizer state for the family's clients (``client_specials``),
    checked against the spec's vocabulary; an encoder-decoder's decoder starts from bos, as the
    translation recipe trains it."""
    if tokenizer is None:
        return {}
    size = to_tokenizers(dict(tokenizer)).get_vocab_size(with_added_tokens=True)
    if size > spec.vocab_size:
        raise HFError(f"the tokenizer has {size:,} tokens but the model's vocab_size is {spec.vocab_size:,}")
    ids = token_ids(dict(tokenizer), spec.architecture, family.start_from_pad)
    if spec.architecture == "encoder-decoder" and "bos_token_id" in ids:
        ids["decoder_start_token_id"] = ids["bos_token_id"]
    return ids


def _our_state(spec, weights) -> tuple[dict, set[str]]:
    """Our tensors by every name they have (aliases of a shared tensor resolved), and the names
    of the tensors the spec's model has."""
    if hasattr(weights, "state_dict"):
        state = weights.state_dict()
    elif isinstance(weights, Mapping):
        state = dict(weights)
    else:
        state = read_weights(weights)
    state = {re.sub(r"^(model\.)?(_orig_mod\.)?", "", k): v for k, v in state.items()}
    # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
    from yamlformer.builder.assemble import build_model

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
    return state, set(model.state_dict())


def export_hf(
    source: str | Path,
    out: str | Path,
    *,
    spec=None,
    weights: str | Path | None = None,
    family: str | None = None,
    extra_config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    adapters: str | None = None,
    init: int | None = None,
) -> Family:
    """``builder export-hf``: a spec file with its weights (``model.safetensors`` beside it unless
    ``weights`` says otherwise) or a ``builder train`` checkpoint (``.ckpt``), written as a
    Hugging Face folder. ``spec``: the spec already loaded (with ``--set`` overrides). Token ids
    come from the checkpoint's tokenizer, or ``hf_config.json`` beside the source (written by
    import), then ``extra_config``. A checkpoint's tokenizer is written with the model; the
    tokenizer and generation files beside a spec (an import's) are copied. ``out`` never holds
    what is read (the source, its weights and side files); an earlier export there is replaced
    only with ``overwrite`` (:mod:`yamlformer.builder.outputs`). A model with adapters (the spec's
    ``adapters``) needs ``adapters``: ``"merge"`` folds them into the weights and writes the plain
    model; ``"peft"`` writes them alone as a PEFT folder for the base (:mod:`yamlformer.builder.hf.peft`)."""
    writes = (CONFIG, WEIGHTS) if adapters == "peft" else EXPORT_FILES
    source, out = Path(source), Path(out)
    side = source.parent
    tokenizer, extra_labels = None, {}
    # the source and its family first, then the output, then the weights: each refusal before the heavy read
    if init is not None and looks_like_checkpoint(source):
        raise HFError("--init: the source is a checkpoint (it has weights); give a spec to export untrained")
    if looks_like_checkpoint(source):
        ckpt_spec, meta = _read_training_meta(source)
        spec = spec or ckpt_spec
        choose_family(unpadded(spec), family)  # a spec no family expresses stops before the weights are read
        _check_adapters(spec, adapters)
        claim_folder(out, writes, [source], overwrite)
        state = _read_training_weights(source)
        tokenizer = meta.get("tokenizer")
        labels = meta.get("labels")
        if isinstance(labels, list) and spec.head.type == "classification":  # a classifier's class names
            names = [str(label) for label in labels]
            extra_labels = {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
    else:
        if spec is None:
            spec = load_spec(source)
        choose_family(unpadded(spec), family)
        weights = Path(weights) if weights else side / "model.safetensors"
        side_files = [p for pattern in SIDE_FILES for p in side.glob(pattern)]  # copied: read too
        _check_adapters(spec, adapters)
        if init is None and not weights.is_file() and not weights.is_symlink():
            raise HFError(
                f"no weights file at {weights}: give --weights FILE, or --init to export the spec with "
                "random weights (untrained)"
            )
        claim_folder(out, writes, [source, weights, side / "hf_config.json", *side_files], overwrite)
        state = read_weights(weights) if init is None else random_weights(spec, init)
    if adapters == "peft":
        chosen, _ = choose_family(spec, family)
        to_peft(spec, state, out, chosen)
        return chosen
    if adapters == "merge":
        spec, state = merged(spec, state)
    extra: dict[str, Any] = {}
    hf_config = side / "hf_config.json"
    if hf_config.is_file():
        extra = {k: v for k, v in read_json(hf_config).items() if k in TOKEN_KEYS and v is not None}
    extra.update(extra_labels)
    extra.update(extra_config or {})
    generation = tokenizer is not None or not (side / "generation_config.json").is_file()
    chosen = to_hf(spec, state, out, family=family, extra_config=extra, tokenizer=tokenizer, generation=generation)
    if tokenizer is None:
        _copy_side_files(side, out)
    return chosen


def random_weights(spec, seed: int) -> dict:
    """The tensors ``spec``'s initialization draws from ``seed`` (an untrained model, to try a
    variant in a runtime before training it: ``export-hf`` / ``export-gguf --init``)."""
    # local: torch loads when weights are drawn
    import torch

    from yamlformer.builder.assemble import build_model

    torch.manual_seed(seed)
    return build_model(spec).state_dict()


def _check_adapters(spec, adapters: str | None) -> None:
    """A model with adapters needs ``--merge`` or ``--adapters-only``, one without neither: else why."""
    if (spec.adapters is None) == (adapters is None):
        return
    if spec.adapters is None:
        option = "--merge" if adapters == "merge" else "--adapters-only"
        raise HFError(f"{option}: the model has no adapters (its spec has no `adapters`); export it without")
    raise HFError(
        f"the model has adapters ({spec.adapters.describe()} on {len(adapted(spec)):,} linear layers): --merge "
        "folds them into the weights and writes the plain model, --adapters-only writes them alone as a PEFT folder"
    )


def _read_training_meta(path: Path):
    """The spec and the ``builder`` metadata of a ``builder train`` checkpoint (one file or a
    sharded folder), read safely; its tensors are verified when :func:`_read_training_weights`
    reads them (``yamlformer.builder.checkpoints``)."""

    try:
        meta = read_meta(path, check=False)["builder"]
        if "spec" not in meta:
            raise CheckpointError(f"{path} was not written by `builder train` (it holds no spec)")
        tokenizer = meta.get("tokenizer")
        if tokenizer is not None and (
            not isinstance(tokenizer, Mapping) or tokenizer.get("type") not in ("char", "sentencepiece", "tokenizers")
        ):
            raise CheckpointError(f"{path}: its tokenizer record is none of char, sentencepiece, tokenizers")
    except CheckpointError as exc:
        raise HFError(str(exc)) from None
    return validate(meta["spec"], source=path), meta


def _read_training_weights(path: Path) -> dict:
    """The model's whole tensors of a ``builder train`` checkpoint, verified against its checksums."""

    try:
        return dedupe(dense(model_weights(read_checkpoint(path))))
    except CheckpointError as exc:
        raise HFError(str(exc)) from None
