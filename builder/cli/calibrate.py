"""``builder plan``'s kernel-rate options: ``--calibrate`` measures this machine's GPU into its
calibration table, which plans for it then read (``yamlformer.builder.analysis.calibration``);
``--cpu`` runs the same machinery on the CPU at 1/64 of every size; ``--calibration-dir`` says where
tables are written and looked for first; ``--attention`` the kernel whose measured rate a run's
attention takes."""

from __future__ import annotations

import argparse
import sys
import time

from yamlformer.builder.analysis.calibration import user_folder


def add_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    """The kernel-rate options (the module doc) on ``builder plan``'s parser."""
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="first measure this machine's GPU (GEMMs, attention kernels, HBM bandwidth; about a minute on an H200) "
        "and write its calibration table, which plans for it then read; with SPEC, plan on it",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="with --calibrate: measure the CPU at 1/64 of every size instead (a check of the machinery: cpu.yaml)",
    )
    parser.add_argument(
        "--calibration-dir",
        metavar="DIR",
        help="where --calibrate writes tables and plans look first (default $BUILDER_CALIBRATION_DIR, else the user "
        "data folder's calibration/)",
    )
    parser.add_argument(
        "--attention",
        choices=("flash", "cudnn", "triton"),
        default="flash",
        help="the attention kernel the run uses: SDPA's flash (default) or cuDNN backend, or this project's Triton "
        "kernel (each at its measured rate)",
    )


def calibrate(args: argparse.Namespace) -> str | None:
    """Measure this machine's GPU (``--cpu``: the CPU's machinery) into its calibration table in
    ``--calibration-dir``; its key (what ``--gpu`` names it), or None (said why) when it cannot."""
    try:
        # local: builder --help imports every command's module; this one's work loads when it runs
        import torch

        from yamlformer.builder.analysis.calibration.table import write_table
        from yamlformer.builder.measure import measure
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        print(f"error: --calibrate needs torch: {exc}", file=sys.stderr)
        return None
    if not args.cpu and not torch.cuda.is_available():
        print("error: --calibrate: no CUDA device here (--cpu checks the machinery on the CPU)", file=sys.stderr)
        return None
    began = time.perf_counter()
    table = measure(cpu=args.cpu, log=lambda message: print(f"  {message}", file=sys.stderr))
    folder = user_folder(args.calibration_dir)
    header = (
        f"{table.gpu}'s kernel rates, measured by `builder plan --calibrate` on {table.measured.device} "
        f"({table.measured.date}, torch {table.measured.torch}); `builder plan --gpu {table.gpu}` reads them."
    )
    try:
        path = write_table(table, folder / f"{table.gpu}.yaml", header)
    except OSError as exc:
        print(f"error: --calibration-dir {folder}: cannot write there: {exc.strerror or exc}", file=sys.stderr)
        return None
    print(f"measured {table.measured.device} in {time.perf_counter() - began:.0f} s: wrote {path} (--gpu {table.gpu})")
    return table.gpu


def calibrate_first(args: argparse.Namespace) -> int | None:
    """What ``builder plan`` does before planning: refuse ``--cpu`` without ``--calibrate``;
    under ``--calibrate`` measure and write the table, then plan on the measured device (its key as
    ``--gpu``) when a spec is given. An exit status to return now, or None to go on planning
    (refusing a plan without SPEC or ``--gpus``)."""
    if args.cpu and not args.calibrate:
        print("error: --cpu goes with --calibrate", file=sys.stderr)
        return 1
    if args.calibrate:
        measured = calibrate(args)
        if measured is None:
            return 1
        if args.spec is None:
            return 0
        args.gpu = measured
    if args.spec is None or args.gpus is None:
        missing = "SPEC" if args.spec is None else "--gpus"
        print(f"error: {missing} is required (unless only --calibrate)", file=sys.stderr)
        return 1
    return None
