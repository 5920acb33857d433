"""`builder report RUN`: a PNG (and with --html a page) of a run's curves, from its run folder alone.

Loss and validation loss, the learning rate, tokens/s and MFU, and the peak memory against the
estimate, read from ``RUN/logs/version_N/metrics.csv`` (the latest version), ``config.yaml`` and
``estimate.json``; matplotlib draws them (``pip install 'yamlformer[plot]'``). Written to
``RUN/report.png`` unless ``-o FILE.png``; ``--html`` also writes the page beside it (``.html``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # local: builder --help imports every command's module; this one's work loads when it runs
    from yamlformer.builder.cli.arguments import output_file

    parser.add_argument("run", metavar="RUN", help="a run folder of `builder train` (its trainer.output_dir)")
    parser.add_argument(
        "-o", "--output", metavar="FILE.png", type=output_file, help="the PNG to write (default: RUN/report.png)"
    )
    parser.add_argument(
        "--html", action="store_true", help="also write an HTML page of the same curves beside the PNG (FILE.html)"
    )


def run(args: argparse.Namespace) -> int:
    # local: a fast command start (builder --help lists this module without importing its work)
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.training.report import pyplot, read_run, write_html, write_png

    try:
        if args.output is not None and Path(args.output).suffix.lower() != ".png":
            raise RecipeError(f"-o {args.output}: give a .png file (--html writes the .html beside it)")
        pyplot()  # the extra first: its absence is one line before any reading
        curves = read_run(args.run)
        png = Path(args.output) if args.output else curves.folder / "report.png"
        written = [write_png(curves, png)]
        if args.html:
            written.append(write_html(curves, png.with_suffix(".html")))
    except RecipeError as exc:
        print(f"builder report: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"builder report: cannot write the report: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
