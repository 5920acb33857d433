"""Check that this project's packages are the ones Python imports, and that ours hide no others'.

The repository's folders ``builder/``, ``blocks/``, ``kernels/`` and ``recipes/`` install under one
import root, as ``yamlformer.builder`` and so on (setup.py maps them), because their bare names
belong to other distributions too: Hugging Face's ``kernels``, which ``transformers`` imports when
a model class loads, is one; the package index has ``builder`` and ``recipes`` as well. Two things
can still go wrong, and both end in errors far from their cause, so :func:`foreign` checks them
without importing anything and says in one line what to do:

* one of our four resolves somewhere other than beside the others, or to files without our mark
  (two installs of this project mixed, or another package's files written over ours);
* the checkout's root is on ``sys.path`` (``python -m ...``, ``python -c`` or a REPL started in
  the clone puts the current folder first), so that a bare ``import kernels`` finds our folder and
  hides the distribution of that name that is installed: ``transformers`` then fails on
  ``from kernels import ...``. The ``builder`` command never has the current folder on its path.

:func:`installed` tells a checkout that was never installed, whose entry points (commands,
document kinds) are missing, and :data:`NOT_INSTALLED` says so.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

DISTRIBUTION = "yamlformer"
#: the import root the four folders install under
ROOT_PACKAGE = "yamlformer"
#: the repository's folders, fixed by the project's layout
FOLDERS = ("builder", "blocks", "kernels", "recipes")
#: their import names
NAMES = tuple(f"{ROOT_PACKAGE}.{folder}" for folder in FOLDERS)
#: every one of our packages' ``__init__.py`` holds this line
MARK = f'__project__ = "{DISTRIBUTION}"'
#: what a checkout that was never installed lacks: what joins through our entry points
NOT_INSTALLED = (
    f"{DISTRIBUTION} is not installed in this Python, so nothing that joins through its entry points "
    "is here (the commands beyond builder's own, such as `builder train`; the document kinds, and so "
    "the zoo's specs and recipes by name): run `pip install -e .` in the checkout"
)


def foreign() -> str | None:
    """A one-line explanation when our packages are not what Python imports, or hide another's."""
    home = Path(__file__).resolve().parent.parent
    for name in NAMES:
        init = _origin(name)
        if init is not None and init.parent.parent == home and _marked(init):
            continue
        where = init.parent if init is not None else "nowhere"
        return (
            f"the module `{name}` resolves to {where}, which is not the {DISTRIBUTION} installed at {home}; "
            f"reinstall {DISTRIBUTION} (`pip uninstall {DISTRIBUTION}` until pip finds none, then "
            "`pip install -e .` in the checkout), or use a separate virtual environment (see the README, "
            "'Package names')"
        )
    for folder in FOLDERS:
        init = _origin(folder)
        if init is None or init.parent.parent != home:
            continue  # the bare name is not our folder: nothing of ours hides anything
        owner = _owner(folder)
        if owner:
            return (
                f"`import {folder}` finds this checkout's {folder}/ folder, which hides the `{owner}` "
                f"distribution's `{folder}` (Python was started in {home}, whose folders it searches first); "
                "use the `builder` command, start Python in another folder, or set PYTHONSAFEPATH=1"
            )
    return None


def renamed_global(refusal: str) -> str | None:
    """What to do with a pickle that names one of our modules by its name before 0.2, when the four
    folders were importable by their bare names (``builder.spec.schema.Spec``): said from the
    message ``torch.load(weights_only=True)`` refuses it with. Checkpoints and weights this project
    writes hold tensors and plain values only (no module names), so they load across the rename;
    only a file pickled by other code with our objects in it names them."""
    match = re.search(r"GLOBAL ((" + "|".join(FOLDERS) + r")\.[\w.]+)", refusal)
    if match is None:
        return None
    return (
        f"it names `{match.group(1)}`, a module path of {DISTRIBUTION} before 0.2 (now "
        f"`{ROOT_PACKAGE}.{match.group(1)}`), and a safe load runs no code to rename it: load it with the "
        "release that wrote it and save its tensors alone (`torch.save(model.state_dict(), path)`)"
    )


def installed() -> bool:
    """Whether this Python has our distribution's metadata (its entry points among them)."""
    # local: importlib.metadata costs ~80 ms; only this check needs it
    import importlib.metadata

    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _origin(name: str) -> Path | None:
    """The ``__init__.py`` that ``import name`` would run, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).resolve() if spec is not None and spec.origin else None


def _marked(init: Path) -> bool:
    try:
        with init.open("rb") as file:
            return MARK.encode() in file.read(8192)
    except OSError:
        return False


def _owner(name: str) -> str | None:
    """Another installed distribution that provides the top-level module ``name`` (slow: only
    where our folder is importable by its bare name)."""
    # local: importlib.metadata costs ~80 ms; only this check needs it
    import importlib.metadata

    owners = [d for d in importlib.metadata.packages_distributions().get(name, []) if d != DISTRIBUTION]
    return owners[0] if owners else None
