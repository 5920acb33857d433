"""What every recipe section is built from, in a module that imports nothing of the recipes: the
base section model, the markers of path fields, :func:`resolve` and :func:`not_a_file`. It sits
below every part of the recipes (the data sections, the recipe's, each task's), so none of them
needs another's back."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

from yamlformer.blocks.configs.base import rule_error
from yamlformer.builder.paths import path_problem

#: ``json_schema_extra`` of the fields that hold paths: relative to the recipe's folder, or to the
#: working directory (``yamlformer.recipes.training.run_log`` makes them absolute in a run's config.yaml)
RECIPE_PATH = {"relative_to": "recipe"}
WORK_PATH = {"relative_to": "cwd"}

#: the data source that means "the Python standard library's own source, from this interpreter"
PYTHON_STDLIB = "python-stdlib"


#: where earlier versions kept caches: under the working directory (still used where it exists)
LEGACY_CACHE = Path(".cache/builder")


def default_cache_dir() -> str:
    """``data.cache_dir`` when a recipe gives none: the user cache (``~/.cache/builder`` on Linux,
    ``~/Library/Caches/builder`` on macOS), so tokenizers and tokenized corpora are made once per
    user, not once per folder a command runs in; ``./.cache/builder`` where an earlier version
    left one (its tokenizers and corpora are reused, not made again)."""
    # local: platformdirs loads only when a recipe gives no cache_dir
    import platformdirs

    if LEGACY_CACHE.is_dir():
        return str(LEGACY_CACHE)
    return platformdirs.user_cache_dir("builder", appauthor=False)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _paths_are_one_line(self):
        """A path field (marked :data:`RECIPE_PATH` or :data:`WORK_PATH`) holding a line break or
        another control character is refused where it is written: such a path is a quoting slip,
        and every message naming it would break over lines."""
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if not (isinstance(extra, dict) and "relative_to" in extra):
                continue
            value = getattr(self, name)
            for index, text in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(text, str) and any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
                    loc = (name, index) if isinstance(value, list) else (name,)
                    message = f"{text!r} holds a line break or another control character; a path is one line"
                    raise rule_error(loc, message)
        return self


def resolve(recipe_file: Path | None, path: str) -> Path:
    """A path written in a recipe, relative to the recipe's folder."""
    p = Path(path).expanduser()
    if p.is_absolute() or recipe_file is None:
        return p
    return Path(recipe_file).resolve().parent / p


def not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file a recipe names (None when it can), worded to follow
    the path: :func:`yamlformer.builder.paths.path_problem`'s verdict (missing, a folder, a
    device such as ``/dev/zero``, a pipe or a socket, which would never end or never answer, or
    unreadable), the one ``builder validate`` gives."""
    why = path_problem(path)
    if why is None:
        return None
    return why if why.startswith("is ") else f"cannot be read: {why}"
