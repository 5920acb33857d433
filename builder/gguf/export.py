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

from yamlformer.builder.gguf.arches import Refused
from yamlformer.builder.gguf.arches_more import arch_of
from yamlformer.builder.gguf.vocab import VocabError, check_vocab, write_vocab

#: what llama.cpp's decoder architectures compute, by spec field (anything else has no GGUF form)
COMPUTED = {
    "position.type": ("rope", "learned", "alibi"),
    "attention.type": ("multi_head", "mla"),
}

#: what llama.cpp's tokenizer keys on ``general.name`` (``llama-vocab.cpp``, as lower-case
#: substrings): "phi3" right-strips the whitespace after every special token and fails to load
#: without ``<unk>``, ``<s>`` and ``<|endoftext|>``, "modern-bert" left-strips ``[MASK]``; a spec
#: named so is written without ``general.name`` (optional), so that the tokenizer gives our ids
NAME_KEYED = ("phi3", "phi-3", "modern-bert")

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


def plan(spec, tokenizer: Mapping | None, family: str | None = None) -> Plan:
    """The family (``family``, else export-hf's choice), GGUF architecture and tokenizer of
    ``spec``, or one line of why not (:class:`GGUFError`); needs neither weights nor ``gguf``."""
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
        raise GGUFError(
            "the model has adapters: export-gguf --merge folds them into the weights, --adapters-only writes "
            "them alone as a GGUF LoRA adapter (for the base's GGUF)"
        )
    if spec.position.type not in COMPUTED["position.type"]:
        raise GGUFError(f"position.type: {spec.position.type!r}; no llama.cpp decoder architecture has it")
    stack = spec.decoder
    for i in range(stack.n_layers):
        kind = stack.layer(i).attention.type
        if kind not in COMPUTED["attention.type"]:
            raise GGUFError(f"decoder.attention.type: {kind!r} (layer {i}); no llama.cpp architecture computes it")
    try:
        family, config = choose_family(unpadded(spec), family)
    except Unsupported as exc:
        raise GGUFError(f"{exc} (GGUF starts from the Hugging Face family: export-hf's choice)") from None
    try:
        arch = arch_of(family.model_type)
        arch.check(config, family.model_type)
        vocab = check_vocab(tokenizer)
    except (Refused, VocabError) as exc:
        raise GGUFError(str(exc)) from None
    return Plan(family.model_type, arch, config, vocab)


def write_gguf(
    spec, state, out: str | Path, outtype: str = "f32", tokenizer=None, description: str = "", family: str | None = None
) -> Plan:
    """Write ``out`` for ``spec`` and ``state`` (our tensors, or a model) as ``family`` (default:
    export-hf's choice); returns the plan."""
    gguf = gguf_module()
    if outtype not in OUTTYPES:
        raise GGUFError(f"--outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    chosen = plan(spec, tokenizer, family)
    # local: torch and the HF writer load when weights are converted
    import torch

    from yamlformer.builder.hf.writer import hf_tensors

    _, config, tensors, _ = hf_tensors(spec, state, chosen.family, tokenizer=tokenizer)
    arch = chosen.arch
    model_arch = getattr(gguf.MODEL_ARCH, arch.name)
    names = gguf.get_tensor_name_map(model_arch, spec.decoder.n_layers)
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

    def fill(writer):
        if not any(part in spec.name.lower() for part in NAME_KEYED):
            writer.add_name(spec.name)
        writer.add_type("model")
        if description:
            writer.add_description(description)
        arch.hparams(writer, config, spec)
        writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_vocab(writer, tokenizer, vocab_rows)

    write_file(gguf, out, model_arch, fill, out_tensors, matrix_type)
    return chosen


def write_file(gguf, out: str | Path, model_arch, fill, tensors: list, matrix_type: str) -> None:
    """Write ``out`` for llama.cpp's ``model_arch``: ``fill(writer)`` adds the metadata, then
    ``tensors`` (``[(gguf_name, numpy array)]``) in their types (:func:`_tensor_type`); through a
    temporary file, so a failed write leaves no partial file."""
    # local: numpy loads when weights are converted
    import numpy as np

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[model_arch])
        fill(writer)
        for name, data in tensors:
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
    converter keeps them, and so do stacked experts' biases (2-D, but added, and ggml adds f32
    only); matrices take ``--outtype``, q8_0 only where rows divide into its blocks."""
    q = gguf.GGMLQuantizationType
    if data.ndim < 2 or name.endswith(".bias") or matrix_type == "F32":
        return q.F32
    kind = getattr(q, matrix_type)
    if kind == q.Q8_0 and data.shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0]:
        return q.F16
    return kind


def merged_spec(spec):
    """The spec a ``--merge`` writes: the same model without its adapters."""
    return spec.model_copy(update={"adapters": None})
