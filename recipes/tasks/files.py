"""The files a recipe reads, collected in order as its task names them
(:attr:`yamlformer.recipes.tasks.task.Resolution.files`): a dataset's splits (on disk under the
data root, or the URL they would come from) and the recipe's own files. Nothing is fetched or
read. Torch-free.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from yamlformer.recipes.data import registry as datasets
from yamlformer.recipes.recipe.located import LocatedRecipe


@dataclasses.dataclass(frozen=True)
class DataFile:
    """One file a run reads: where, whether it is there, and where it would come from."""

    what: str  # "tinyshakespeare", "data.train.source"
    path: Path | None  # None: the files of this machine (python-stdlib)
    present: bool
    url: str | None = None
    size: int | None = None
    terms: str | None = None
    file: bool = False  # read whole as one file (a folder of files is not taken)


class DataFiles:
    """What a task's :meth:`~yamlformer.recipes.tasks.task.Resolution.add_files` adds its files to."""

    def __init__(self, located: LocatedRecipe):
        self.located, self.found = located, []
        data = located.recipe.data
        names = [getattr(s, "path", s) for s in getattr(data, "sources", [])]
        uses = data.dataset is not None or any(name in datasets.DATASETS for name in names)
        self._root = datasets.data_root(data.dataset_root(located.file)) if uses else None

    def is_dataset(self, name: str) -> bool:
        return name in datasets.DATASETS

    def registry(self, name: str):
        """The registry's :class:`yamlformer.recipes.data.registry.Dataset` called ``name``."""
        return datasets.get(name)

    def add(self, what: str, path: Path | None, present: bool, **where) -> None:
        self.found.append(DataFile(what, path, present, **where))

    def dataset(self, name: str, splits: list[str]) -> None:
        """The files of dataset ``name``'s ``splits``."""
        spec = datasets.get(name)
        if spec.local is not None:
            self.add(name, None, True, terms=spec.license)
            return
        base = self._root or datasets.data_root(self.located.recipe.data.dataset_root(self.located.file))
        for split in splits:
            for path in spec.splits[split].values():
                remote = spec.file(path)
                where = base.joinpath(*remote.path.split("/"))
                terms = spec.license if spec.restricted else None
                self.add(
                    f"{name} {split}", where, where.exists(), url=remote.url, size=remote.size, terms=terms, file=True
                )

    def own(self, what: str, path: str | None) -> None:
        """A file the recipe names (``None``: not set)."""
        if path is not None:
            where = self.located.path(path)
            self.add(what, where, where.exists(), file=True)
