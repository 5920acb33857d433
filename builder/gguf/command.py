"""``builder export-gguf``'s work: a checkpoint or a spec (with its weights, or ``--init``'s) read,
every refusal made before the weights are, then the model written by :mod:`.export` (or its
adapters alone by :mod:`.lora`)."""

from __future__ import annotations

from pathlib import Path

from yamlformer.builder.gguf.export import OUTTYPES, GGUFError, Plan, gguf_module, merged_spec, plan, write_gguf
from yamlformer.builder.gguf.lora import lora_plan, write_lora


def export_gguf(
    source: str | Path,
    out: str | Path,
    *,
    spec=None,
    weights: str | Path | None = None,
    outtype: str = "f32",
    init: bool = False,
    seed: int = 0,
    tokenizer: str | Path | None = None,
    merge: bool = False,
    adapters_only: bool = False,
    overwrite: bool = False,
    family: str | None = None,
) -> tuple[Plan, str]:
    """``builder export-gguf``: a ``builder train`` checkpoint, or a spec file with its weights
    (``model.safetensors`` beside it, ``weights``, or ``init``: the random weights the spec's
    initialization draws with ``seed``), written as ``out``. The tokenizer: the checkpoint's,
    else ``tokenizer`` (a checkpoint, a model folder, a ``tokenizer.json`` or a sentencepiece
    ``.model``), else an import's beside the spec. ``adapters_only``: the adapters alone, as a
    GGUF LoRA adapter (:mod:`.lora`; no tokenizer). ``family``: the Hugging Face family to
    write as (default: export-hf's choice, the first that expresses the spec exactly). Returns
    the plan and what the weights are."""
    # local: the checkpoint and HF readers load with the command
    from yamlformer.builder.checkpoints import looks_like_checkpoint
    from yamlformer.builder.hf.common import HFError
    from yamlformer.builder.hf.peft import merged
    from yamlformer.builder.hf.writer import _read_training_meta, _read_training_weights, random_weights
    from yamlformer.builder.outputs import claim_file
    from yamlformer.builder.spec.loader import load_spec

    source, out = Path(source), Path(out)
    inputs = [source]
    state_tokenizer = None
    try:
        if looks_like_checkpoint(source):
            if init:
                raise GGUFError("--init: the source is a checkpoint (it has weights); give a spec to export untrained")
            ckpt_spec, meta = _read_training_meta(source)
            spec = spec or ckpt_spec
            state_tokenizer = meta.get("tokenizer")
        else:
            spec = spec or load_spec(source)
            if not init:
                weights = Path(weights) if weights else source.parent / "model.safetensors"
                if not weights.is_file():
                    raise GGUFError(
                        f"no weights file at {weights}: give --weights FILE, or --init to export the spec "
                        "with random weights (untrained)"
                    )
                inputs.append(weights)
        if tokenizer is not None:
            state_tokenizer = _tokenizer_from(Path(tokenizer))
            inputs.append(tokenizer)
        elif state_tokenizer is None and source.is_file() and not looks_like_checkpoint(source):
            state_tokenizer = _tokenizer_from(source.parent, optional=True)  # an import's, beside its spec
        if merge and adapters_only:
            raise GGUFError("--merge and --adapters-only: give one (the adapters folded in, or them alone)")
        if merge and spec.adapters is None:
            raise GGUFError("--merge: the model has no adapters (its spec has no `adapters`); export it without")
        if adapters_only and family is not None:
            raise GGUFError("--family with --adapters-only: the adapter is written for the base's own family")
        if adapters_only:
            chosen = lora_plan(spec)  # every refusal before the weights are read
        else:
            chosen = plan(merged_spec(spec) if merge else spec, state_tokenizer, family)
        if outtype not in OUTTYPES:
            raise GGUFError(f"--outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
        claim_file(out, inputs, overwrite)
        gguf_module()  # after the refusals, which need no gguf
        if looks_like_checkpoint(source):
            state, what = _read_training_weights(source), f"trained weights ({source.name})"
        elif init:
            state, what = random_weights(spec, seed), f"random weights (--init, seed {seed}): untrained"
        else:
            # local: safe tensor IO
            from yamlformer.builder.hf.weights import read_weights

            state, what = read_weights(weights), f"weights {Path(weights).name}"
        if merge:
            spec, state = merged(spec, state)
            what += ", adapters merged"
    except HFError as exc:
        raise GGUFError(str(exc)) from None
    if adapters_only:
        what = f"{spec.adapters.describe()} adapters alone, of {what} (apply over the base's GGUF)"
        write_lora(spec, state, out, outtype, description=what)
        return chosen, what
    write_gguf(spec, state, out, outtype, state_tokenizer, description=what, family=family)
    return chosen, what


def _tokenizer_from(path: Path, optional: bool = False):
    """A tokenizer state from ``path``: a checkpoint's, a model folder's or ``tokenizer.json``,
    or a sentencepiece ``.model``; ``optional``: None where a folder has none."""
    # local: the readers load with the command
    from yamlformer.builder.checkpoints import looks_like_checkpoint
    from yamlformer.builder.hf.tokenizer import read_tokenizer

    if looks_like_checkpoint(path):
        # local: the checkpoint reader
        from yamlformer.builder.hf.writer import _read_training_meta

        state = _read_training_meta(path)[1].get("tokenizer")
    elif path.is_dir():
        state = read_tokenizer(path)
    elif path.name.endswith(".json"):
        state = read_tokenizer(path.parent, only=path.name)
    else:
        # local: the readers load with the command
        from yamlformer.builder.hf.checks import read_bytes
        from yamlformer.builder.hf.tokenizer import _proto

        proto = read_bytes(path, "tokenizer", path.parent)
        _proto(proto)
        state = {"type": "sentencepiece", "model_proto": proto}
    if state is None and not optional:
        raise GGUFError(f"--tokenizer {path}: holds no tokenizer (tokenizer.json or tokenizer.model)")
    return state
