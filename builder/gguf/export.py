"""``builder export-gguf``: a model of ours as one GGUF file for llama.cpp, written with ``gguf``
(gguf-py, llama.cpp's own writer).

The weights take the way ``builder export-hf`` gives them (the Hugging Face family that expresses
the spec exactly, :func:`yamlformer.builder.hf.writer.hf_tensors`), then llama.cpp's names
(``gguf``'s tensor name map for the architecture) and layouts (:mod:`.arches`), the
architecture's hyperparameter keys, and the tokenizer as GGUF metadata (:mod:`.vocab`).
Everything that can refuse does so before the weights are read or the file is opened: the
family, the architecture's keys, the tokenizer, the output path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from yamlformer.builder.gguf.arches import Refused, arch_of
from yamlformer.builder.gguf.vocab import VocabError, check_vocab, write_vocab

#: what llama.cpp's decoder architectures compute, by spec field (anything else has no GGUF form)
COMPUTED = {
    "position.type": ("rope", "learned", "alibi"),
    "attention.type": ("multi_head", "mla"),
}

#: ``--outtype`` -> (GGML tensor type for matrices, GGUF file type name)
OUTTYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
            "q8_0": ("Q8_0", "MOSTLY_Q8_0")}  # fmt: skip


class GGUFError(ValueError):
    """An export that cannot be written: one line."""


def gguf_module():
    """``gguf``, or a one-line :class:`GGUFError` naming the extra that installs it."""
    try:
        import gguf  # optional extra (yamlformer[gguf])
    except ImportError:
        raise GGUFError("export-gguf needs gguf (llama.cpp's writer): pip install 'yamlformer[gguf]'") from None
    return gguf


@dataclass
class Plan:
    """What an export will write, settled before any weights are read."""

    family: str
    arch: object
    config: dict
    vocab: str


def plan(spec, tokenizer: Mapping | None) -> Plan:
    """The family, GGUF architecture and tokenizer of ``spec``, or one line of why not
    (:class:`GGUFError`); needs neither weights nor ``gguf``."""
    # local: the HF family table loads with the command
    from yamlformer.builder.hf.common import Unsupported
    from yamlformer.builder.hf.weights import unpadded
    from yamlformer.builder.hf.writer import choose_family

    if spec.architecture != "decoder-only":
        raise GGUFError(
            f"architecture: {spec.architecture}; llama.cpp runs decoder-only language models "
            "(its encoder-decoder T5 and embedding-only encoders are not written here)"
        )
    if spec.head.type != "lm":
        raise GGUFError(f"head.type: {spec.head.type}; llama.cpp's decoders end in a language-model head")
    if spec.adapters is not None:
        raise GGUFError("the model has adapters: export-gguf --merge folds them into the weights")
    if spec.position.type not in COMPUTED["position.type"]:
        raise GGUFError(f"position.type: {spec.position.type!r}; no llama.cpp decoder architecture has it")
    stack = spec.decoder
    for i in range(stack.n_layers):
        kind = stack.layer(i).attention.type
        if kind not in COMPUTED["attention.type"]:
            raise GGUFError(f"decoder.attention.type: {kind!r} (layer {i}); no llama.cpp architecture computes it")
    try:
        family, config = choose_family(unpadded(spec))
    except Unsupported as exc:
        raise GGUFError(f"{exc} (GGUF starts from the Hugging Face family: export-hf's choice)") from None
    try:
        arch = arch_of(family.model_type)
        arch.check(config, family.model_type)
        vocab = check_vocab(tokenizer)
    except (Refused, VocabError) as exc:
        raise GGUFError(str(exc)) from None
    return Plan(family.model_type, arch, config, vocab)


def write_gguf(spec, state, out: str | Path, outtype: str = "f32", tokenizer=None, description: str = "") -> Plan:
    """Write ``out`` for ``spec`` and ``state`` (our tensors, or a model); returns the plan."""
    gguf = gguf_module()
    if outtype not in OUTTYPES:
        raise GGUFError(f"--outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    chosen = plan(spec, tokenizer)
    # local: torch and the HF writer load when weights are converted
    import numpy as np
    import torch

    from yamlformer.builder.hf.writer import hf_tensors

    _, config, tensors, _ = hf_tensors(spec, state, chosen.family, tokenizer=tokenizer)
    arch = chosen.arch
    model_arch = getattr(gguf.MODEL_ARCH, arch.name)
    names = gguf.get_tensor_name_map(model_arch, config.get("num_hidden_layers") or config["n_layer"])
    matrix_type, file_type = OUTTYPES[outtype]
    out_tensors = []
    for hf_name, tensor in _experts_stacked(tensors).items():
        for name, data in arch.transform(hf_name, tensor.detach().to(torch.float32).cpu(), config):
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise GGUFError(f"tensor {name}: llama.cpp's {arch.name.lower()} has no tensor of that name")
            out_tensors.append((gguf_name, data.numpy()))
    out_tensors += [(name, t.numpy()) for name, t in arch.extra(config).items()]
    vocab_rows = next(t.shape[0] for n, t in out_tensors if n == "token_embd.weight")
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # a failed write leaves no partial file
    try:
        writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[model_arch])
        writer.add_name(spec.name)
        writer.add_type("model")
        if description:
            writer.add_description(description)
        arch.hparams(writer, config, spec)
        writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_vocab(writer, tokenizer, vocab_rows)
        for name, data in out_tensors:
            qtype = _tensor_type(gguf, name, data, matrix_type)
            if qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(name, data.astype(np.float32))
            elif qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(name, data.astype(np.float16))
            else:
                writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return chosen


def _experts_stacked(tensors: dict) -> dict:
    """Each layer's experts (``...experts.3.w1.weight``) as one 3-D tensor (``...experts.w1.weight``,
    expert-major), as llama.cpp holds a mixture of experts."""
    # local: torch loads when weights are converted
    import torch

    out: dict = {}
    groups: dict[str, dict[int, object]] = {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.+)", name)
        if match is None:
            out[name] = tensor
            continue
        stacked = f"{match[1]}.{match[3]}"
        groups.setdefault(stacked, {})[int(match[2])] = tensor
        out.setdefault(stacked, None)  # keeps the first expert's place in the order
    for stacked, experts in groups.items():
        out[stacked] = torch.stack([experts[i] for i in sorted(experts)])
    return out


def _tensor_type(gguf, name: str, data, matrix_type: str):
    """The type one tensor is stored in: vectors (norms, biases) stay f32, as llama.cpp's
    converter keeps them; matrices take ``--outtype``, q8_0 only where rows divide into its blocks."""
    q = gguf.GGMLQuantizationType
    if data.ndim < 2 or matrix_type == "F32":
        return q.F32
    kind = getattr(q, matrix_type)
    if kind == q.Q8_0 and data.shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0]:
        return q.F16
    return kind


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
    overwrite: bool = False,
) -> tuple[Plan, str]:
    """``builder export-gguf``: a ``builder train`` checkpoint, or a spec file with its weights
    (``model.safetensors`` beside it, ``weights``, or ``init``: the random weights the spec's
    initialization draws with ``seed``), written as ``out``. The tokenizer: the checkpoint's,
    else ``tokenizer`` (a checkpoint, a model folder, a ``tokenizer.json`` or a sentencepiece
    ``.model``), else an import's beside the spec. Returns the plan and what the weights are."""
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
        if merge and spec.adapters is None:
            raise GGUFError("--merge: the model has no adapters (its spec has no `adapters`); export it without")
        spec_out = merged_spec(spec) if merge else spec
        chosen = plan(spec_out, state_tokenizer)  # every refusal before the weights are read
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
    write_gguf(spec, state, out, outtype, state_tokenizer, description=what)
    return chosen, what


def merged_spec(spec):
    """The spec a ``--merge`` writes: the same model without its adapters."""
    return spec.model_copy(update={"adapters": None})


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
