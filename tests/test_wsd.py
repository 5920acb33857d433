"""Warmup-stable-decay (``schedule.type: wsd``) and cooldowns branched from its stable phase
(``builder train RECIPE --cooldown-from CKPT --steps N``): the schedule's shapes and fields, which
schedule changes a resume allows (the learning rate of every step taken unchanged), and a cooldown
that trains in its own folder, from the checkpoint's state, resumably."""

from __future__ import annotations

import math

import pytest
import torch
from recipe_helpers import tiny_recipe

from yamlformer.builder.spec.source import SpecError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.optim.schedule import lr_multiplier, same_through
from yamlformer.recipes.recipe.sections import ScheduleSection
from yamlformer.recipes.tasks import load_recipe
from yamlformer.recipes.training.run_folder import recipe_differences


def test_wsd_warms_up_holds_then_decays_in_its_shape():
    for shape, halfway in (("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))):
        wsd = ScheduleSection(type="wsd", warmup_steps=10, decay_steps=20, decay_shape=shape, min_lr=0.0)
        values = [lr_multiplier(s, wsd, lr=1.0, max_steps=100) for s in range(101)]
        assert values[9] == pytest.approx(10 / 11) and values[10:80] == [1.0] * 70  # warmup, then stable
        assert values[90] == pytest.approx(halfway) and values[100] == 0.0  # the decay's middle and its end
        assert all(a >= b for a, b in zip(values[80:], values[81:]))
    by_share = ScheduleSection(type="wsd", warmup_steps=0, decay_fraction=0.25, min_lr=0.1)
    assert lr_multiplier(74, by_share, 1.0, 100) == 1.0 and lr_multiplier(100, by_share, 1.0, 100) == pytest.approx(0.1)
    default = ScheduleSection(type="wsd", warmup_steps=0)  # 0.2 of the run decays, as 1 - sqrt
    assert lr_multiplier(79, default, 1.0, 100) == 1.0 and lr_multiplier(90, default, 1.0, 100) == pytest.approx(
        1 - math.sqrt(0.5)
    )


def test_wsd_fields_are_checked_where_written(tmp_path):
    for schedule, path, message in (
        ({"type": "wsd", "decay_steps": 10, "decay_fraction": 0.1}, "schedule.decay_fraction", "not both"),
        ({"type": "cosine", "decay_fraction": 0.1}, "schedule.decay_fraction", "a wsd schedule's"),
        ({"type": "wsd", "decay_shape": "exponential"}, "schedule.decay_shape", "linear"),
    ):
        recipe = tiny_recipe(tmp_path, schedule=schedule)
        with pytest.raises(SpecError) as info:
            load_recipe(recipe)
        (problem,) = info.value.problems
        assert problem.path == path and message in problem.message and problem.line is not None


def test_a_resume_may_change_the_schedule_only_where_every_step_taken_had_the_same_learning_rate(tmp_path):
    stable = load_recipe(
        tiny_recipe(tmp_path, schedule={"type": "wsd", "warmup_steps": 2, "decay_fraction": 0.25})
    ).recipe
    longer = stable.model_copy(update={"trainer": stable.trainer.model_copy(update={"max_steps": 40})})
    other = stable.model_copy(update={"schedule": stable.schedule.model_copy(update={"warmup_steps": 4})})
    # 12 steps, the last 3 decaying: step 10 is the first whose rate is lowered
    assert same_through(stable, longer, 10) and not same_through(stable, longer, 11)
    assert not same_through(stable, other, 8)
    dumps = [r.model_dump(mode="json") for r in (stable, longer)]
    refused, allowed = recipe_differences(*dumps, step=8)
    assert refused == [] and any(line.startswith("trainer.max_steps") for line in allowed)
    shaped = [stable.model_dump(mode="json"), {**dumps[1], "schedule": {**dumps[1]["schedule"], "decay_steps": 4}}]
    shaped[1]["schedule"]["decay_fraction"] = None
    assert recipe_differences(*shaped, step=8)[0] == []
    assert [line.split(":")[0] for line in recipe_differences(*shaped, step=11)[0]] == [
        "schedule.decay_fraction",
        "schedule.decay_steps",
    ]


def test_a_cooldown_branches_from_a_stable_checkpoint_into_its_own_folder_and_resumes(tmp_path):
    from yamlformer.recipes.training.cooldown import cooldown
    from yamlformer.recipes.training.run import run

    schedule = {"type": "wsd", "warmup_steps": 2, "decay_fraction": 0.25}
    trainer = {"max_steps": 8, "keep_every_n_steps": 4, "val_check_interval": 4, "checkpoint_every_n_steps": 4}
    path = tiny_recipe(tmp_path, schedule=schedule, trainer=trainer)
    run(path, samples=False)
    branch = tmp_path / "run" / "checkpoints" / "branch-4.ckpt"
    assert branch.is_file() and (tmp_path / "run" / "checkpoints" / "branch-8.ckpt").is_file()

    summary = cooldown(path, None, branch, 2, samples=False)
    folder = tmp_path / "run-cooldown-4+2"
    assert summary["steps"] == 6 and summary["output_dir"] == str(folder)
    saved = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    recipe = saved["builder"]["recipe"]
    assert recipe["schedule"]["decay_steps"] == 2 and recipe["trainer"]["max_steps"] == 6
    assert saved["builder"]["history"]["train"][0][0] <= 4  # the stable run's history goes on in the branch
    (rate,) = saved["lr_schedulers"][0]["_last_lr"][:1]
    assert rate == pytest.approx(3e-3 * 0.0)  # at its end: min_lr 0 (1 - sqrt(1))

    again = cooldown(path, None, branch, 2, samples=False)  # resumes its own folder: nothing left to train
    assert again["steps"] == 6
    with pytest.raises(RecipeError, match="outside the stable phase"):
        cooldown(path, None, tmp_path / "run" / "checkpoints" / "branch-8.ckpt", 2, samples=False)
    (tmp_path / "cosine").mkdir()
    cosine = tiny_recipe(tmp_path / "cosine", schedule={"type": "cosine"})
    with pytest.raises(RecipeError, match="schedule is cosine"):
        cooldown(cosine, None, branch, 2, samples=False)
