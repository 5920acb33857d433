"""``builder consolidate CKPT -o model.safetensors``: a training checkpoint (a sharded folder
written by ``trainer.strategy: fsdp``, or one file) as one safetensors file of the model's whole
weights, read in one process whatever layout wrote it. The spec goes in the file's metadata;
``builder export-hf SPEC --weights model.safetensors`` and ``builder.load_weights`` read it.
The checkpoint is read by ``yamlformer.builder.checkpoints`` and written by ``yamlformer.builder.hf.weights``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from yamlformer.builder.checkpoints import CheckpointError, load_model, peek_meta, user_mode, write_reason
from yamlformer.builder.hf.weights import save_weights
from yamlformer.builder.outputs import OutputError, claim_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint written by `builder train` (folder or file)")
    parser.add_argument("-o", "--out", required=True, metavar="FILE", help="the .safetensors file to write")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace FILE if it exists (never the checkpoint: refused even so)"
    )


def consolidate(path: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the model's whole weights of a checkpoint to one ``.safetensors`` file (a tied tensor
    once); the spec (JSON) and step go in its metadata. Written beside ``out`` and renamed over
    it, so a failed write leaves no partial file (a :class:`CheckpointError` says why). An
    existing ``out`` is replaced only with ``overwrite``, and never when it is (or is inside) the
    checkpoint (:class:`yamlformer.builder.outputs.OutputError`)."""
    peek_meta(path)  # a checkpoint that is not there, or not ours, is named first (a cheap read)
    claim_file(out, [path], overwrite)
    model, builder = load_model(path)
    metadata = {"spec": json.dumps(builder["spec"]), "global_step": str(builder.get("global_step"))}
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # a failed write leaves no partial file
    try:
        save_weights(model, tmp, metadata=metadata)
        user_mode(tmp)
        os.replace(tmp, out)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, Exception):
            raise CheckpointError(f"cannot write {out}: {write_reason(exc)}") from None
        raise
    return out


def run(args: argparse.Namespace) -> int:
    if not args.out.endswith(".safetensors"):
        print(f"builder consolidate: -o {args.out}: the output is a .safetensors file", file=sys.stderr)
        return 1
    try:
        path = consolidate(args.checkpoint, args.out, args.overwrite)
    except (CheckpointError, OutputError) as exc:
        print(f"builder consolidate: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the output: an unwritable or full folder, a path that cannot be made
        print(f"builder consolidate: cannot write {args.out}: {exc.strerror or type(exc).__name__}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
