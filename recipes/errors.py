"""The errors every part of the recipes raises, in a module that imports nothing: the command line
prints them as one line (``builder train: ...``) and never a traceback."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe that cannot run as written (missing data, a window longer than the model...)."""
