"""This project's four top-level names are generic; check that each one is really ours.

``builder``, ``blocks``, ``kernels`` and ``recipes`` are fixed by the project's layout, but other
distributions use the same names (Hugging Face's ``kernels``, which ``transformers`` can load, is
one). When one of them is installed beside this project, ``import kernels`` can find its files
instead of ours (an editable install is searched after site-packages), or its files can overwrite
ours in the same folder. Both end in confusing errors far from the cause, so :func:`foreign`
checks, without importing anything, that each name resolves to a folder beside ``builder`` whose
``__init__.py`` carries this project's mark, and says in one line what to do when not.
:func:`installed` tells a checkout that was never installed, whose entry points (commands,
document kinds) are missing, and :data:`NOT_INSTALLED` says so.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DISTRIBUTION = "transformer-builder"
NAMES = ("builder", "blocks", "kernels", "recipes")
#: every one of our packages' ``__init__.py`` holds this line
MARK = f'__project__ = "{DISTRIBUTION}"'
#: what a checkout that was never installed lacks: what joins through our entry points
NOT_INSTALLED = (
    f"{DISTRIBUTION} is not installed in this Python, so nothing that joins through its entry points "
    "is here (the commands beyond builder's own, such as `builder train`; the document kinds, and so "
    "the zoo's specs and recipes by name): run `pip install -e .` in the checkout"
)


def foreign() -> str | None:
    """A one-line explanation when one of our names resolves to another distribution's files."""
    home = Path(__file__).resolve().parent.parent
    for name in NAMES:
        spec = importlib.util.find_spec(name)
        init = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if init is not None and init.parent.parent == home and _marked(init):
            continue
        where = init.parent if init is not None else "nowhere"
        owner = _owner(name)
        return (
            f"the module `{name}` resolves to {where}, which is not {DISTRIBUTION}'s"
            + (f" (it belongs to the `{owner}` distribution)" if owner else "")
            + f"; uninstall the other package (`pip uninstall {owner or name}`) and reinstall "
            f"{DISTRIBUTION}, or use a separate virtual environment (see the README, 'Package names')"
        )
    return None


def installed() -> bool:
    """Whether this Python has our distribution's metadata (its entry points among them)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _marked(init: Path) -> bool:
    try:
        with init.open("rb") as file:
            return MARK.encode() in file.read(8192)
    except OSError:
        return False


def _owner(name: str) -> str | None:
    """The other distribution that installs ``name`` (slow: only on the error path)."""
    import importlib.metadata

    owners = [d for d in importlib.metadata.packages_distributions().get(name, []) if d != DISTRIBUTION]
    return owners[0] if owners else None
