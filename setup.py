"""Installs the repository's four folders under one import root, and ships the spec zoo.

The folders ``builder/``, ``blocks/``, ``kernels/`` and ``recipes/`` stay where the project's
layout puts them; installed, they are ``yamlformer.builder``, ``yamlformer.blocks``,
``yamlformer.kernels`` and ``yamlformer.recipes`` (setuptools' ``package_dir`` maps each folder
under the root). Their bare names belong to other distributions (Hugging Face's ``kernels``, which
``transformers`` imports, among them), so nothing here is importable by them. ``yamlformer`` itself
has no folder: a namespace package holding the four.

The repository's ``specs/`` goes into the wheel as ``yamlformer/builder/zoo/specs``
(``yamlformer.builder.zoo`` reads it there; an editable install reads ``specs/`` at the repository
root instead). Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
IMPORT_ROOT = "yamlformer"
FOLDERS = ("builder", "blocks", "kernels", "recipes")


class BuildWithZoo(build_py):
    """``build_py`` that also copies ``specs/**/*.yaml`` (and its README) to ``builder/zoo/specs``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads specs/ where it is
        target = Path(self.build_lib) / IMPORT_ROOT / "builder" / "zoo" / "specs"
        for source in sorted((ROOT / "specs").rglob("*")):
            if source.is_file() and source.suffix in (".yaml", ".yml", ".md"):
                dest = target / source.relative_to(ROOT / "specs")
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, dest)


setup(
    cmdclass={"build_py": BuildWithZoo},
    package_dir={f"{IMPORT_ROOT}.{folder}": folder for folder in FOLDERS},
    packages=[
        f"{IMPORT_ROOT}.{package}"
        for package in find_packages(where=str(ROOT), include=[f"{folder}*" for folder in FOLDERS])
    ],
)
