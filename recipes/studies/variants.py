"""A study's axes as variants, each checked before any trial starts: its recipe loads with its
values, its spec validates, and its exact parameters and FLOPs per token (``builder describe``'s)
set its steps from the budget. A problem is one line, at the study's line for a value written
there (``study.yaml:9:3: axes.optimizer.lrr: unknown key 'lrr'; did you mean 'lr'?``) and naming
the variant that has it. Torch-free.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from yamlformer.builder.spec.source import Problem, SpecError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.sections import spec_shorthand
from yamlformer.recipes.studies.schema import VARIANT_AXIS, Distribution, StudyFile
from yamlformer.recipes.tasks import load_recipe, recipe_class
from yamlformer.recipes.training.dry_run import data_parallel_ranks, recipe_estimate
from yamlformer.recipes.training.resolved import resolve_model


@dataclasses.dataclass
class Variant:
    """One trial's settings: the axis values, the ``--set`` overrides they make, and what the
    variant's model is and costs."""

    name: str  # names its run folder: a rerun of the same values resumes there
    values: dict[str, Any]  # axis -> value (named variants by their name; the budget as budget.KIND)
    overrides: dict[str, Any]  # recipe --set key -> value: the study's set, the values, the budget
    family: str  # the values that change the model ("d_model=64 n_layers=2"); "" when none do
    params: int
    non_embedding: int
    flops_per_token: int  # training FLOPs per token, exact
    tokens_per_step: int
    steps: int | None  # None: a minutes budget, steps as the recipe sets them
    budget: dict[str, float]  # {"flops": 1e13}

    @property
    def tokens(self) -> int | None:
        return None if self.steps is None else self.steps * self.tokens_per_step

    @property
    def flops(self) -> float | None:
        return None if self.steps is None else float(self.tokens) * self.flops_per_token

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: the most variants a study may have: each is checked before any trial starts (its recipe loaded,
#: its spec validated and counted: some 10 ms each), and a grid runs every one as a training run
MAX_VARIANTS = 1000


class NothingToRun(RecipeError):
    """A study none of whose variants can run: each distinct problem, one line each."""


@dataclasses.dataclass
class Invalid:
    """A variant that cannot run, and why (one line per problem)."""

    name: str
    values: dict[str, Any]
    error: str


def axis_values(loaded: StudyFile) -> dict[str, list]:
    """Each axis and its values as a grid takes them (a range: its two ends); the named variants
    and a list of budgets are axes too."""
    study = loaded.study
    axes = {name: ([a.low, a.high] if isinstance(a, Distribution) else list(a)) for name, a in study.axes.items()}
    if study.variants is not None:
        axes[VARIANT_AXIS] = list(study.variants)
    budgets = study.budget.values()
    if len(budgets) > 1:
        axes[budget_axis(loaded)] = budgets
    return axes


def budget_axis(loaded: StudyFile) -> str:
    return f"budget.{loaded.study.budget.kind}"


def combinations(loaded: StudyFile) -> list[dict[str, Any]]:
    """Every combination of the axes' values (a grid's trials; for a search, what is checked);
    more than :data:`MAX_VARIANTS` is refused, naming the axes and their sizes, before any is made."""
    axes = axis_values(loaded)
    size = math.prod(len(values) for values in axes.values())
    if size > MAX_VARIANTS:
        shorts = short_names(list(axes))
        sizes = " x ".join(f"{shorts[name]} {len(values):,}" for name, values in axes.items())
        what = (
            "narrow the axes, or draw total.trials of them with search: random or tpe"
            if loaded.study.search == "grid"
            else "a search checks every combination of its lists and range ends: give fewer list values"
        )
        raise SpecError(
            [
                Problem.at(
                    loaded.mark("axes"),
                    "axes",
                    f"{size:,} variants ({sizes}), more than a study checks before it runs ({MAX_VARIANTS:,}); {what}",
                )
            ]
        )
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def short_names(names: list[str]) -> dict[str, str]:
    """The last part of each dotted axis name, longer where two would clash (``lr``, ``decoder.n_layers``)."""
    out = {}
    for name in names:
        parts = name.split(".")
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            if sum(1 for other in names if other == short or other.endswith("." + short)) == 1:
                break
        out[name] = short
    return out


def variant_name(values: dict[str, Any]) -> str:
    """A folder name of the values: ``d_model=64-n_layers=2-lr=0.003`` (a hash when too long)."""
    shorts = short_names(list(values))
    text = "-".join(f"{shorts[k]}={show(v)}" for k, v in values.items()) or "base"
    text = re.sub(r"[^A-Za-z0-9_.=+-]", "_", text)
    if len(text) > 100:
        digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:10]
        text = f"{text[:80]}-{digest}"
    return text


def show(value: Any) -> str:
    """A value as tables and names show it (``0.003``, ``1e+13``)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def axis_overrides(loaded: StudyFile, axis: str, value: Any) -> dict[str, tuple[Any, tuple]]:
    """One axis value's ``--set`` overrides: ``key -> (value, where the study wrote it)`` (a named
    variant's mapping; a budget sets none here, :func:`check` turns it into steps)."""
    if axis == VARIANT_AXIS:
        return {key: (v, ("variants", value, key)) for key, v in loaded.study.variants[value].items()}
    if axis.startswith("budget."):
        return {}
    return {axis: (value, ("axes", axis))}


def overrides_of(loaded: StudyFile, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """``(--set overrides, where each key was written in the study)``: the study's ``set``, then the
    values in axis order."""
    overrides: dict[str, Any] = dict(loaded.study.set)
    where = {key: ("set", key) for key in loaded.study.set}
    for axis, value in values.items():
        for key, (setting, path) in axis_overrides(loaded, axis, value).items():
            overrides[key], where[key] = setting, path
    return overrides, where


def variant_model(loaded: StudyFile, values: dict[str, Any]):
    """``(resolution, spec, overrides)`` of the variant of ``values``: what its task made of its
    recipe (:class:`~yamlformer.recipes.tasks.task.Resolution`), the spec checked against that
    task; :class:`RecipeError` (one located line per problem) when it cannot run."""

    overrides, where = overrides_of(loaded, values)
    try:
        located = load_recipe(loaded.recipe_file(), overrides)
        resolution, _, spec = resolve_model(located)  # checked against its task, as a run checks it
    except SpecError as exc:
        raise RecipeError("\n".join(_relocated(loaded, p, where) for p in exc.problems)) from None
    return resolution, spec, overrides


def step_shape(resolution, spec) -> tuple[int, int, int]:
    """``(seq_len, batch, sequences)``: a step's sequence length and per-rank batch as the task
    cuts them, and the sequences of one optimizer step over every data-parallel rank."""

    seq_len, batch, _ = resolution.batch_shape(spec)
    recipe = resolution.recipe
    return seq_len, batch, batch * recipe.trainer.accumulate_grad_batches * data_parallel_ranks(recipe)


def check(loaded: StudyFile, values: dict[str, Any]) -> Variant:
    """The variant of ``values``, its model validated and counted and its steps set from the
    budget; :class:`RecipeError` (one line per problem) when it cannot run."""

    resolution, spec, overrides = variant_model(loaded, values)
    recipe = resolution.recipe
    seq_len, batch, sequences = step_shape(resolution, spec)
    est = recipe_estimate(spec, recipe, seq_len, batch, reference=resolution.reference_copy(spec))
    per_step = seq_len * sequences
    kind, amount = next(iter(budget_of(loaded, values).items()))
    per_token = est.flops.train_per_token
    steps = {
        "steps": lambda: int(amount),
        "tokens": lambda: math.ceil(amount / per_step),
        "flops": lambda: math.ceil(amount / (per_token * per_step)),
        "minutes": lambda: None,
    }[kind]()
    recipe_cls = recipe_class(recipe.task)
    spec_axes = [  # the axes that change the model: an override of theirs reaches model.*
        axis
        for axis in values
        if any(
            key.startswith("model.")
            for key in spec_shorthand(dict.fromkeys(axis_overrides(loaded, axis, values[axis])), recipe_cls)
        )
    ]
    shorts = short_names(list(values))
    return Variant(
        name=variant_name(values),
        values=values,
        overrides={**overrides, **_run_settings(loaded, recipe, kind, amount, steps)},
        family=" ".join(f"{shorts[a]}={show(values[a])}" for a in spec_axes),
        params=est.params.total,
        non_embedding=est.params.non_embedding,
        flops_per_token=per_token,
        tokens_per_step=per_step,
        steps=steps,
        budget={kind: amount},
    )


def budget_of(loaded: StudyFile, values: dict[str, Any]) -> dict[str, float]:
    """``{kind: amount}``: the trial budget of a variant's values."""
    budget = loaded.study.budget
    return {budget.kind: values.get(budget_axis(loaded), budget.values()[0])}


def _run_settings(loaded: StudyFile, recipe, kind: str, amount: float, steps: int | None) -> dict[str, Any]:
    """The trainer settings a budget makes: the steps, a validation every 1/validations of them
    (a checkpoint with each), and a time bound only for a minutes budget."""
    validations = loaded.study.budget.validations
    if kind == "minutes":
        seconds = round(amount * 60)
        return {"trainer.max_time": f"00:{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"}
    every = max(1, steps // validations)
    return {
        "trainer.max_steps": steps,
        "trainer.max_time": None,
        "trainer.val_check_interval": every,
        "trainer.checkpoint_every_n_steps": every,
        "trainer.log_every_n_steps": max(1, min(recipe.trainer.log_every_n_steps, every)),
    }


def _relocated(loaded: StudyFile, problem, where: dict[str, tuple]) -> str:
    """A problem of a value the study wrote, at the study's line for it; others as they are."""
    match = re.match(r"<--set ([^=>]+)=", problem.file)
    if match:
        key = match.group(1)
        for written, path in where.items():
            if key in (written, written.removeprefix("model.overrides."), f"model.overrides.{written}"):
                mark = loaded.mark(*path)
                at = mark.file if mark.line is None else f"{mark.file}:{mark.line}:{mark.col}"
                return f"{at}: {'.'.join(str(p) for p in path)}: {problem.message}"
    return str(problem)


def plan(loaded: StudyFile, progress: bool = False) -> tuple[list[Variant], list[Invalid]]:
    """Every combination checked: ``(variants that run, variants that cannot)``. A search's ranges
    are checked at their ends. A study none of whose variants can run is :class:`NothingToRun`,
    each distinct problem once (an axis naming no field: its one line). ``progress``: a bar on
    stderr once the checks take more than a second (on a terminal)."""
    variants, invalid = [], []
    every = combinations(loaded)
    shown = tqdm(
        every, desc="checking variants", unit="variant", delay=1.0, leave=False, disable=None if progress else True
    )
    for values in shown:
        try:
            variants.append(check(loaded, values))
        except RecipeError as exc:
            invalid.append(Invalid(variant_name(values), values, str(exc)))
    if not variants:
        raise NothingToRun("\n".join(dict.fromkeys(line for bad in invalid for line in bad.error.splitlines())))
    return variants, invalid


def train_command(loaded: StudyFile, variant: Variant, devices: int = 0, python: str | None = None) -> list[str]:
    """The ``builder train`` command of a variant's trial, in its own run folder (under torchrun
    for several devices). ``python``: the interpreter (default this one); ``"builder"`` writes
    the command as a person types it."""

    if python == "builder":
        head = (
            ["torchrun", "--standalone", f"--nproc-per-node={devices}", "-m", "yamlformer.builder.cli"]
            if devices > 1
            else []
        )
        head = head or ["builder"]
    else:
        python = python or sys.executable
        head = [python, "-m", "yamlformer.builder.cli"]
        if devices > 1:
            head = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}", "-m"]
            head += ["yamlformer.builder.cli"]
    sets = {**variant.overrides, "trainer.output_dir": str(trial_dir(loaded, variant.name).resolve())}
    if devices:
        sets["trainer.devices"] = devices
    args = itertools.chain.from_iterable(("--set", f"{key}={json.dumps(value)}") for key, value in sets.items())
    return [*head, "train", str(loaded.recipe_file()), *args, "--no-samples"]


def trial_dir(loaded: StudyFile, name: str) -> Path:
    """A variant's run folder: the same values always run (and resume) in the same folder."""
    return loaded.root / "trials" / name
