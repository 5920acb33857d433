"""Options every command shares: ``--set dotted.key=value`` and ``--plugin module``.

A command calls :func:`add_spec_options` in its ``add_arguments`` and :func:`spec_from_args`
(or :func:`overrides_from_args` and :func:`load_plugins_from_args`) in ``run``::

    def add_arguments(parser):
        parser.add_argument("spec", metavar="SPEC")
        add_spec_options(parser)

    def run(args):
        spec = spec_from_args(args)      # prints located problems and exits 1 on a bad spec
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from yamlformer.builder.spec.loader import SpecError, load_spec, parse_set_args
from yamlformer.builder.spec.plugins import PluginError, load_plugins


def add_spec_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--set KEY=VALUE`` (repeatable) and ``--plugin MODULE`` (repeatable)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field after `extends:`, e.g. --set decoder.n_layers=2 (value read as YAML)",
    )
    add_plugin_option(parser)


def add_plugin_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--plugin MODULE`` (repeatable): blocks from the user's own package."""
    parser.add_argument(
        "--plugin",
        dest="plugins",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first; it registers extra blocks (yamlformer.blocks.registry.register)",
    )


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--set`` values parsed as YAML; raises ``SpecError`` for a malformed one."""
    return parse_set_args(getattr(args, "overrides", None) or [])


def load_plugins_from_args(args: argparse.Namespace) -> None:
    """Import the ``yamlformer.blocks`` entry points and every ``--plugin``; raises ``PluginError``."""
    load_plugins(getattr(args, "plugins", None) or [])


def spec_from_args(args: argparse.Namespace, path: str | None = None, exit_on_error: bool = True):
    """Load the spec named by ``path`` (default ``args.spec``) with the ``--set``/``--plugin`` options.

    On a bad spec, a bad ``--set`` or a failing plugin, prints the located problems on stderr and
    exits with status 1 (``exit_on_error=False`` raises ``SpecError``/``PluginError`` instead).
    """
    try:
        load_plugins_from_args(args)
        return load_spec(path if path is not None else args.spec, overrides_from_args(args))
    except (SpecError, PluginError) as exc:
        if not exit_on_error:
            raise
        print(exc, file=sys.stderr)
        raise SystemExit(1) from None
