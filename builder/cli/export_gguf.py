"""``builder export-gguf (CKPT | SPEC) -o FILE.gguf``: a model of ours as one GGUF file for llama.cpp.

``CKPT`` is a checkpoint written by ``builder train`` (its tokenizer goes with it); ``SPEC`` a
spec file with its weights beside it (``model.safetensors``), named by ``--weights``, or drawn
at random by ``--init`` (an untrained model, to try a variant in llama.cpp before training it).
The file is written with ``gguf`` (llama.cpp's own writer) as the llama.cpp architecture that
runs the spec's Hugging Face family, the tokenizer as GGUF metadata that llama.cpp's tokenizer
reads to our ids. A spec llama.cpp cannot run exactly (an encoder-decoder, a field no GGUF key
says) exits 1 before anything is written, in one line naming the field. A model with LoRA
adapters takes ``--merge`` (folded into the weights) or ``--adapters-only`` (a GGUF LoRA adapter
that llama.cpp applies over the base's GGUF).
"""

from __future__ import annotations

import argparse
import sys

from yamlformer.builder.cli.arguments import MAX_SEED, count, input_file, input_path, output_file
from yamlformer.builder.cli.common import add_spec_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="CKPT|SPEC", help="a training checkpoint, or a spec file")
    parser.add_argument("-o", "--out", required=True, metavar="FILE.gguf", type=output_file, help="the file to write")
    parser.add_argument(
        "--outtype",
        choices=("f32", "f16", "bf16", "q8_0"),
        default="f32",
        help="the matrices' type (norms and biases stay f32; q8_0 falls back to f16 for rows not a multiple "
        "of 32) (default f32)",
    )
    parser.add_argument(
        "--weights",
        metavar="FILE",
        type=input_file,
        help="a spec's weights (.safetensors; default: model.safetensors beside the spec)",
    )
    parser.add_argument(
        "--init",
        action="store_true",
        help="a spec without weights: random weights from the spec's initialization (untrained; said in the file)",
    )
    parser.add_argument(
        "--seed", type=count(minimum=0, maximum=MAX_SEED), default=0, help="--init's random seed (default 0)"
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        type=input_path,
        help="the tokenizer to write: a checkpoint, a model folder, a tokenizer.json or a sentencepiece .model "
        "(default: the checkpoint's, or an import's beside the spec; none: token ids only)",
    )
    parser.add_argument(
        "--family",
        metavar="NAME",
        help="the Hugging Face model_type to write as, and so llama.cpp's architecture (default: export-hf's "
        "choice, the first that expresses the spec exactly; e.g. phi3 for llama.cpp's phi3)",
    )
    parser.add_argument("--merge", action="store_true", help="a model with adapters: fold them into the weights first")
    parser.add_argument(
        "--adapters-only",
        action="store_true",
        help="a model with LoRA adapters: write them alone as a GGUF LoRA adapter, which llama.cpp applies over "
        "the base model's GGUF (--lora)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace FILE.gguf if it exists")
    add_spec_options(parser)


def run(args: argparse.Namespace) -> int:
    # local: builder --help imports every command's module; this one's work loads when it runs
    from yamlformer.builder.checkpoints import looks_like_checkpoint
    from yamlformer.builder.cli.common import spec_from_args
    from yamlformer.builder.gguf import export_gguf

    spec = None
    if not looks_like_checkpoint(args.source):
        spec = spec_from_args(args, args.source)  # exits 1 with located problems
    try:
        plan, what = export_gguf(
            args.source,
            args.out,
            spec=spec,
            weights=args.weights,
            outtype=args.outtype,
            init=args.init,
            seed=args.seed,
            tokenizer=args.tokenizer,
            merge=args.merge,
            adapters_only=args.adapters_only,
            overwrite=args.overwrite,
            family=args.family,
        )
    except ValueError as exc:  # GGUFError, OutputError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    vocab = "the base GGUF's" if args.adapters_only else plan.vocab
    print(
        f"wrote {args.out}: llama.cpp {plan.arch.name.lower()} (from Hugging Face {plan.family}), {args.outtype}, "
        f"{what}; tokenizer: {vocab}"
    )
    return 0
