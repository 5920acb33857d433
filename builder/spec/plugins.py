"""User blocks and optimizers: loaded from the ``yamlformer.blocks`` and ``yamlformer.optimizers``
entry-point groups and from ``--plugin``.

A plugin is a module that registers config classes with ``yamlformer.blocks.registry.register`` (or
``yamlformer.builder.optim.register``) when it is imported; the schema picks them up
(``yamlformer.builder.spec.schema.spec_model`` rebuilds when the
registry changes). A spec never imports code by itself: only an installed package's entry
point or a module named on the command line (``--plugin mypackage.blocks``) runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Iterable

GROUP = "yamlformer.blocks"
#: every entry-point group a plugin joins through: blocks, and optimizers (``yamlformer.builder.optim``)
GROUPS = (GROUP, "yamlformer.optimizers")

_loaded: set[str] = set()
_entry_points_loaded = [False]


class PluginError(ImportError):
    """A plugin module or entry point that cannot be imported."""


#: an importable module's absolute name
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def load_plugins(modules: Iterable[str] = (), entry_points: bool = True) -> list[str]:
    """Import the :data:`GROUPS` entry points (once per process) and ``modules``.

    Returns the names imported by this call. Raises :class:`PluginError` naming the plugin.
    """
    imported = []
    if entry_points and not _entry_points_loaded[0]:
        _entry_points_loaded[0] = True
        for group in GROUPS:
            for entry in importlib.metadata.entry_points(group=group):
                try:
                    entry.load()
                except Exception as exc:
                    raise PluginError(f"entry point {entry.name!r} ({entry.value}) of {group!r} failed: {exc}") from exc
                imported.append(entry.value)
    for name in modules:
        if name in _loaded:
            continue
        if not isinstance(name, str) or not _MODULE_NAME.fullmatch(name):
            raise PluginError(f"plugin {name!r} is not a module name: give a dotted name such as mypackage.blocks")
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise PluginError(f"plugin {name!r} not found: {exc}; is it installed or on PYTHONPATH?") from exc
        except Exception as exc:
            raise PluginError(f"plugin {name!r} failed to import: {type(exc).__name__}: {exc}") from exc
        _loaded.add(name)
        imported.append(name)
    return imported
