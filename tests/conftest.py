"""Suite-wide settings and the fixtures several test modules share."""

import os
import sys
from pathlib import Path

import pytest
import torch

# The suite imports the installed `yamlformer` packages, never the checkout's folders by their bare
# names: `python -m pytest` puts the checkout's root first on sys.path, where its `kernels/` would
# hide Hugging Face's `kernels` from `transformers`. Child Pythons the tests start keep it off too.
_CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _CHECKOUT]
os.environ["PYTHONSAFEPATH"] = "1"

from yamlformer.builder.spec.plugins import load_plugins

# Tiny models on a 2-core CI machine: one intra-op thread avoids oversubscription, which made
# small decoding loops up to ~100x slower when the cores were busy.
torch.set_num_threads(1)

# The registry-walking tests (tests/test_block_counts.py, tests/test_contracts.py...) cover every
# registered block: the built-ins, installed plugins (the `yamlformer.blocks` entry points) and the
# modules named here, e.g. `BUILDER_PLUGINS=mypackage.blocks pytest tests/test_contracts.py`.
load_plugins([name for name in os.environ.get("BUILDER_PLUGINS", "").split(",") if name.strip()])


@pytest.fixture(scope="session")
def unbroken_run(tmp_path_factory):
    """``recipe_helpers.fault_recipe`` trained to its end without a break: the losses and weights a
    run broken by a fault (a signal, a full disk, a damaged checkpoint) must end with once resumed.
    Returns ``(recipe file, summary)``."""
    from recipe_helpers import fault_recipe

    from yamlformer.recipes.training.run import run

    recipe = fault_recipe(tmp_path_factory.mktemp("unbroken"))
    return recipe, run(recipe, samples=False)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real SLURM of two nodes on this host for the ``launch`` tests (``tests/slurm_helpers.py``),
    stopped after the session; skips, saying why, where it cannot start (not root, not installed)."""
    import slurm_helpers

    why = slurm_helpers.missing()
    if why is not None:
        pytest.skip(why)
    with slurm_helpers.cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
