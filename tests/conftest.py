"""Suite-wide settings and the fixtures several test modules share."""

import pytest
import torch

# Tiny models on a 2-core CI machine: one intra-op thread avoids oversubscription, which made
# small decoding loops up to ~100x slower when the cores were busy.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def unbroken_run(tmp_path_factory):
    """``recipe_helpers.fault_recipe`` trained to its end without a break: the losses and weights a
    run broken by a fault (a signal, a full disk, a damaged checkpoint) must end with once resumed.
    Returns ``(recipe file, summary)``."""
    from recipe_helpers import fault_recipe

    from recipes.train import run

    recipe = fault_recipe(tmp_path_factory.mktemp("unbroken"))
    return recipe, run(recipe, samples=False)
