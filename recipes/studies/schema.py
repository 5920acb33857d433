"""The study file: a base recipe, the axes that vary over it (a grid, named variants, or a search
space for random or TPE search), a budget per trial and in all, how many trials run at once, and
where the study is stored. Torch-free; read as recipes are, every problem located
(``study.yaml:7:3: axes.d_model: ...``).

```yaml
recipe: lm-stdlib                       # a recipe file (relative to this file) or a zoo name
set: {data.max_bytes: 4000000}          # --set values every trial takes
axes:                                   # recipe or spec fields (spec shorthand as with --set)
  d_model: [64, 128]
  optimizer.lr: [1.0e-3, 3.0e-3]
budget: {flops: [1.0e13, 3.0e13]}       # per trial: steps, tokens, flops or minutes (a list: one more axis)
```
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from yamlformer.builder.spec.loader import validate_document
from yamlformer.builder.spec.problems import rule_error
from yamlformer.builder.spec.source import Mark, Problem, SpecError, read_document
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import _Section
from yamlformer.recipes.recipe.sections import recipe_path

#: how a budget per trial may be given; exactly one of them
BUDGETS = ("steps", "tokens", "flops", "minutes")
#: the axis a list of named variants is
VARIANT_AXIS = "variant"


class Distribution(_Section):
    """A range random and TPE search sample from (a list is a categorical axis)."""

    low: float = Field(..., description="The least value.")
    high: float = Field(..., description="The greatest value.")
    log: bool = Field(False, description="Sample on a log scale (learning rates).")
    integer: bool = Field(False, description="Whole numbers only (widths, depths).")

    @model_validator(mode="after")
    def _ordered(self):
        if not self.low < self.high:
            raise ValueError(f"low {self.low:g} must be less than high {self.high:g}")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low:g}")
        return self


class TrialBudget(_Section):
    """What one trial may spend: exactly one of steps, tokens, FLOPs or minutes. A list of values
    is one more axis of the study (several budgets per variant: what a scaling-law fit needs)."""

    steps: int | list[int] | None = Field(None, description="Optimizer steps (trainer.max_steps).")
    tokens: float | list[float] | None = Field(
        None, description="Training tokens; steps = tokens / the tokens of one optimizer step."
    )
    flops: float | list[float] | None = Field(
        None, description="Training FLOPs; steps from the variant's exact FLOPs per token (builder describe)."
    )
    minutes: float | list[float] | None = Field(
        None, description="Wall-clock minutes (trainer.max_time); steps as the recipe sets them."
    )
    validations: int = Field(5, ge=1, le=1000, description="Validations per trial (the curve and the pruner).")
    time_limit: float | None = Field(
        None, gt=0, description="Minutes after which a trial that has not ended is killed and failed (a hang)."
    )

    @model_validator(mode="after")
    def _one(self):
        given = [name for name in BUDGETS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(BUDGETS)}; got {', '.join(given) or 'none'}")
        for value in self.values():
            if not value > 0:
                raise ValueError(f"{self.kind} must be positive, got {value}")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in BUDGETS if getattr(self, name) is not None)

    def values(self) -> list:
        value = getattr(self, self.kind)
        return list(value) if isinstance(value, list) else [value]


class StudyBudget(_Section):
    """What the whole study may spend; a sweep starts no trial past it."""

    trials: int | None = Field(None, ge=1, description="Trials in all (random and TPE search need it).")
    minutes: float | None = Field(None, gt=0, description="The trials' wall-clock minutes, added up.")
    flops: float | None = Field(None, gt=0, description="The trials' training FLOPs, added up.")


class Parallel(_Section):
    """How many trials one ``builder sweep`` runs at once on its machine."""

    trials: int = Field(1, ge=1, le=256, description="Trials at once (processes).")
    devices: int = Field(
        0, ge=0, le=64, description="GPUs each trial gets (CUDA_VISIBLE_DEVICES; >1 runs it under torchrun); 0: CPU."
    )


class Pruner(_Section):
    """Early stopping of hopeless trials: Optuna's median rule on the validation loss, comparing
    trials at the same validation (the same fraction of their budget)."""

    type: Literal["median", "none"] = Field("median", description="median: stop a trial worse than the median.")
    warmup: int = Field(1, ge=0, description="Validations of a trial before it may be stopped.")
    min_trials: int = Field(3, ge=1, description="Finished trials before any is stopped.")


class Downstream(_Section):
    """lm-evaluation-harness tasks scored on each finished trial's best checkpoint (``builder eval --tasks``)."""

    tasks: list[str] = Field(..., min_length=1, description="Task names (lm-eval's, or defined under include).")
    include: str | None = Field(None, description="A folder of task YAML files (relative to the study file).")
    limit: int | None = Field(None, ge=1, description="Examples per task (default: all).")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples (default: the task's).")


class Study(_Section):
    """A study file. Attribute names are the YAML keys."""

    file_kind: ClassVar[str] = "a study"

    name: str | None = Field(None, description="The study's name in its database (default: the file name).")
    recipe: str = Field(..., description="The base recipe: a file relative to this one, or a zoo name.")
    set: dict[str, Any] = Field(default_factory=dict, description="--set values every trial takes.")
    search: Literal["grid", "random", "tpe"] = Field(
        "grid", description="grid: every combination; random or tpe: total.trials draws from the axes (Optuna)."
    )
    axes: dict[str, list[Any] | Distribution] = Field(
        default_factory=dict, description="Field -> its values (a list) or, for random and tpe, a range."
    )
    variants: dict[str, dict[str, Any]] | None = Field(
        None, description="Named variants, each a mapping of --set values: one more axis, called 'variant'."
    )
    budget: TrialBudget = Field(..., description="What one trial may spend.")
    total: StudyBudget = Field(default_factory=StudyBudget, description="What the study may spend in all.")
    parallel: Parallel = Field(default_factory=Parallel, description="Trials at once on this machine.")
    pruner: Pruner | None = Field(None, description="Stop hopeless trials early (default: none).")
    downstream: Downstream | None = Field(None, description="Downstream tasks scored on each finished trial.")
    rank_by: str = Field(
        "val_loss",
        description="What the report ranks by: val_loss, or TASK/METRIC of a downstream task (higher first).",
    )
    storage: str | None = Field(
        None,
        description="An Optuna storage URL (default: sqlite:///OUTPUT_DIR/study.db); a server for several machines.",
    )
    output_dir: str | None = Field(None, description="Where trials and reports go (default: studies/NAME).")
    seed: int = Field(0, description="The sampler's seed (random, tpe).")

    @model_validator(mode="after")
    def _axes(self):
        """The rules over several fields, each located at the field it is about (rule_error)."""
        if self.variants is not None and VARIANT_AXIS in self.axes:
            raise rule_error(("axes", VARIANT_AXIS), "the named variants are that axis; rename the field")
        for name, axis in self.axes.items():
            if isinstance(axis, list) and not axis:
                raise rule_error(("axes", name), "an axis needs at least one value")
            if isinstance(axis, Distribution) and self.search == "grid":
                raise rule_error(("axes", name), "a range is for search: random or tpe; a grid takes a list of values")
        if self.variants is not None and not self.variants:
            raise rule_error(("variants",), "give at least one named variant, or leave it out")
        if self.search != "grid" and self.total.trials is None:
            raise rule_error(("search",), f"{self.search} draws total.trials trials; set total.trials")
        if self.rank_by != "val_loss":
            task = self.rank_by.partition("/")[0]
            if self.downstream is None or task not in self.downstream.tasks or "/" not in self.rank_by:
                tasks = ", ".join(self.downstream.tasks) if self.downstream else "none"
                raise rule_error(
                    ("rank_by",),
                    f"{self.rank_by!r} is val_loss or TASK/METRIC of a downstream task (downstream.tasks: {tasks})",
                )
        return self


@dataclasses.dataclass
class StudyFile:
    """A loaded study: the validated :class:`Study`, its file and its located document."""

    study: Study
    path: Path
    document: Any  # yamlformer.builder.spec.source.Document: where each key was written

    @property
    def name(self) -> str:
        return self.study.name or self.path.stem

    @property
    def root(self) -> Path:
        """Where its trials and reports go."""
        return Path(self.study.output_dir or Path("studies") / self.name)

    @property
    def storage(self) -> str:
        return self.study.storage or f"sqlite:///{(self.root / 'study.db').resolve()}"

    @property
    def default_storage(self) -> bool:
        return self.study.storage is None

    def recipe_file(self) -> Path:
        """The base recipe: a file beside the study, else a zoo name."""

        near = self.path.resolve().parent / self.study.recipe
        return near if near.is_file() else recipe_path(self.study.recipe)

    def mark(self, *path):
        """Where ``path`` was written (a key's mark, else its nearest written parent's)."""

        for n in range(len(path), 0, -1):
            found = self.document.key_mark(tuple(path[:n]))
            if found is not None:
                return found
        return Mark(str(self.path))

    def definition(self) -> dict:
        """What fixes the study's variants: a database's study must have been made by the same."""
        study = self.study
        return {
            "recipe": str(self.recipe_file().resolve()),
            "set": study.set,
            "search": study.search,
            "axes": {k: v.model_dump() if isinstance(v, Distribution) else v for k, v in study.axes.items()},
            "variants": study.variants,
            "budget": {study.budget.kind: getattr(study.budget, study.budget.kind)},
            "validations": study.budget.validations,
        }

    def fingerprint(self) -> str:
        text = json.dumps(self.definition(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_study(path: str | Path) -> StudyFile:
    """Read and validate a study file; ``SpecError`` with every located problem, ``RecipeError``
    when its base recipe is not found."""
    path = Path(path)
    fields = sorted(Study.model_fields, key=lambda f: not Study.model_fields[f].is_required())
    document = read_document(path, str(path), fields, "a study")
    study = validate_document(document, Study, str(path))
    loaded = StudyFile(study, path, document)
    try:
        loaded.recipe_file()
    except RecipeError as exc:
        raise SpecError([Problem.at(loaded.mark("recipe"), "recipe", str(exc))]) from None
    return loaded
