"""``builder consolidate CKPT -o model.safetensors``: a training checkpoint (a sharded folder
written by ``trainer.strategy: fsdp``, or one file) as one safetensors file of the model's whole
weights, read in one process whatever layout wrote it. The spec goes in the file's metadata;
``builder export-hf SPEC --weights model.safetensors`` and ``builder.load_weights`` read it.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint written by `builder train` (folder or file)")
    parser.add_argument("-o", "--out", required=True, metavar="FILE", help="the .safetensors file to write")


def run(args: argparse.Namespace) -> int:
    from builder.checkpoints import CheckpointError, consolidate

    if not args.out.endswith(".safetensors"):
        print(f"builder consolidate: -o {args.out}: the output is a .safetensors file", file=sys.stderr)
        return 1
    try:
        path = consolidate(args.checkpoint, args.out)
    except CheckpointError as exc:
        print(f"builder consolidate: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the output: an unwritable or full folder, a path that cannot be made
        print(f"builder consolidate: cannot write {args.out}: {exc.strerror or type(exc).__name__}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
