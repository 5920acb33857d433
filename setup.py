"""Ships the spec zoo inside the package: the repository's ``specs/`` goes into the wheel as
``builder/zoo/specs`` (``builder.zoo`` reads it there; a checkout or an editable install reads
``specs/`` at the repository root instead). Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithZoo(build_py):
    """``build_py`` that also copies ``specs/**/*.yaml`` (and its README) to ``builder/zoo/specs``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads specs/ where it is
        target = Path(self.build_lib) / "builder" / "zoo" / "specs"
        for source in sorted((ROOT / "specs").rglob("*")):
            if source.is_file() and source.suffix in (".yaml", ".yml", ".md"):
                dest = target / source.relative_to(ROOT / "specs")
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, dest)


setup(cmdclass={"build_py": BuildWithZoo})
