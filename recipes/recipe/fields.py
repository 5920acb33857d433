"""What every recipe section is built from, in a module that imports nothing of the project: the
base section model, the markers of path fields and :func:`resolve`. Section modules elsewhere
(``yamlformer.recipes.data.section``, each task's) import them from here, so no section module needs
``yamlformer.recipes.recipe.sections`` back."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

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
    import platformdirs

    if LEGACY_CACHE.is_dir():
        return str(LEGACY_CACHE)
    return platformdirs.user_cache_dir("builder", appauthor=False)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)


def resolve(recipe_file: Path | None, path: str) -> Path:
    """A path written in a recipe, relative to the recipe's folder."""
    p = Path(path).expanduser()
    if p.is_absolute() or recipe_file is None:
        return p
    return Path(recipe_file).resolve().parent / p
