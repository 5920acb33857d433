"""``builder export-hf (SPEC | CKPT) -o DIR``: a model of ours as a Hugging Face folder.

``SPEC`` is a spec file with its weights beside it (``model.safetensors``, as ``import-hf``
writes them) or named by ``--weights``; ``CKPT`` a checkpoint written by ``builder train``.
Writes ``DIR/config.json`` and ``DIR/model.safetensors`` for the first Hugging Face family that
expresses the spec exactly (or ``--family``), loadable with ``transformers``' Auto classes; a
checkpoint's tokenizer as ``tokenizer.json`` (with ``tokenizer_config.json`` and its special
tokens) and ``generation_config.json``, so ``AutoTokenizer`` and ``pipeline("text-generation")``
load the folder (an import's tokenizer files are carried over). A spec no family expresses exits
1 before any weights are read, in one line naming the nearest family and the first field it
would change. A model with adapters (a LoRA/DoRA run's checkpoint) takes ``--merge`` (the
adapters folded into the weights: a plain folder) or ``--adapters-only`` (``adapter_config.json``
and ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` loads onto the base's
export).
"""

from __future__ import annotations

import argparse
import json
import sys

from yamlformer.builder.checkpoints import looks_like_checkpoint
from yamlformer.builder.cli.arguments import MAX_SEED, count, input_file, output_folder
from yamlformer.builder.cli.common import add_spec_options, spec_from_args
from yamlformer.builder.hf import HFError, export_hf
from yamlformer.builder.hf.writer import EXPORT_FILES
from yamlformer.builder.outputs import Snapshot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SPEC|CKPT", help="a spec file (weights beside it) or a training checkpoint")
    parser.add_argument(
        "-o",
        "--out",
        required=True,
        metavar="DIR",
        type=output_folder,
        help="folder to write config.json and model.safetensors",
    )
    parser.add_argument(
        "--weights",
        metavar="FILE",
        type=input_file,
        help="weights (.safetensors, or .pt read with weights_only; "
        "default: model.safetensors beside the spec, or the checkpoint's own)",
    )
    parser.add_argument(
        "--init",
        action="store_true",
        help="a spec without weights: random weights from the spec's initialization (untrained: a variant "
        "to try in a runtime first)",
    )
    parser.add_argument(
        "--seed", type=count(minimum=0, maximum=MAX_SEED), default=0, help="--init's random seed (default 0)"
    )
    parser.add_argument(
        "--family", metavar="NAME", help="the Hugging Face model_type to write (default: the first that fits)"
    )
    adapters = parser.add_mutually_exclusive_group()
    adapters.add_argument(
        "--merge",
        dest="adapters",
        action="store_const",
        const="merge",
        help="a model with adapters: fold them into the weights and write the plain model",
    )
    adapters.add_argument(
        "--adapters-only",
        dest="adapters",
        action="store_const",
        const="peft",
        help="a model with adapters: write them alone as a PEFT folder (adapter_config.json, "
        "adapter_model.safetensors) for peft.PeftModel.from_pretrained over the base's export",
    )
    parser.add_argument(
        "--hf-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config.json key a spec does not hold, e.g. --hf-config pad_token_id=0 (value read as JSON)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in DIR (never the source or its weights: refused even so)",
    )
    add_spec_options(parser)


def _pairs(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--hf-config takes KEY=VALUE, got {item!r}")
        if len(value) > 1 << 16:
            raise ValueError(f"--hf-config {key}: the value is longer than {1 << 16:,} characters")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
        except RecursionError:
            raise ValueError(f"--hf-config {key}: the value is nested too deeply") from None
    return out


def run(args: argparse.Namespace) -> int:
    spec = None
    if not looks_like_checkpoint(args.source):
        spec = spec_from_args(args, args.source)  # exits 1 with located problems
    before = Snapshot.of(args.out, EXPORT_FILES)  # what this export writes, told from what was there
    try:
        family = export_hf(
            args.source,
            args.out,
            spec=spec,
            weights=args.weights,
            family=args.family,
            extra_config=_pairs(args.hf_config),
            overwrite=args.overwrite,
            adapters=args.adapters,
            init=args.seed if args.init else None,
        )
    except (HFError, ValueError) as exc:  # OutputError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the output folder: unwritable, full, or a path that cannot be made
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if args.adapters == "peft":
        print(
            f"wrote {args.out}/adapter_config.json and adapter_model.safetensors: PEFT LoRA for a {family.hf_class} "
            f"(peft.PeftModel.from_pretrained({family.auto_class}.from_pretrained(BASE), {str(args.out)!r}))"
        )
        return 0
    others = ", ".join(name for name in before.written() if name != "model.safetensors")
    untrained = f"; random weights (--init, seed {args.seed}): untrained" if args.init else ""
    print(
        f"wrote {args.out}/model.safetensors{' and ' + others if others else ''}: "
        f"{family.hf_class} ({family.auto_class}){untrained}"
    )
    return 0
