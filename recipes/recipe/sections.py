"""The recipe file: what to train, on what, and how. Torch-free.

A recipe is YAML validated by :class:`Recipe` (``extra="forbid"``: a typo fails with its file,
line and the closest valid name, through :func:`yamlformer.builder.spec.loader.load_config`). Paths in a recipe
(the model spec, data files, a tokenizer ``.model``) are relative to the recipe file; the output
directory is relative to where ``builder train`` runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from yamlformer.blocks.configs.base import rule_error
from yamlformer.builder.optim import optimizer_field
from yamlformer.builder.optim.configs import AdamWConfig
from yamlformer.builder.spec.loader import (
    apply_overrides,
    load_config,
    load_spec,
    locate_file,
    read_merged,
    validate_document,
)
from yamlformer.builder.spec.problems import locate as locate_problem
from yamlformer.builder.spec.schema import ModelSpec, spec_model
from yamlformer.builder.spec.source import Document, Mark, Problem, SpecError
from yamlformer.builder.zoo import ZooError, locate
from yamlformer.recipes.data.section import DataSection, DatasetFields, SourceEntry, TokenizerSection  # noqa: F401 (re-exported)
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import WORK_PATH, _Section
from yamlformer.recipes.recipe.init_from import init_from_errors, spec_base
from yamlformer.recipes.recipe.loggers import LoggersSection
from yamlformer.recipes.recipe.parallelism import ParallelismFields, check_recipe_parallelism

if TYPE_CHECKING:
    from yamlformer.builder.init_from import Source

#: every task, by its ``task:`` value: a folder of ``yamlformer.recipes.tasks`` each; ``lm`` is the default
TASKS = ("lm", "translation", "mlm", "classification", "sft", "preference")

#: one part of a model.freeze path: a module name, a layer index, a range of them, or *
_FREEZE_SEGMENT = r"(?:\*|[A-Za-z_][A-Za-z0-9_]*|\d+(?:-\d+)?)"
_FREEZE_PATH = re.compile(rf"{_FREEZE_SEGMENT}(?:\.{_FREEZE_SEGMENT})*")


class ModelSection(_Section):
    spec: str | dict[str, Any] | None = Field(
        None,
        description="A spec file (path relative to the recipe) or an inline spec mapping (null: the spec "
        "of init_from).",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Spec fields set over the spec, as dotted keys (`decoder.n_layers: 2`) or nested "
        "mappings; `--set model.overrides.decoder.n_layers=2` lands here. `vocab_size` is always "
        "set to the tokenizer's.",
    )
    init_from: str | None = Field(
        None,
        description="Start from trained weights (relative to the recipe): a `builder train` checkpoint "
        "(.ckpt; its tokenizer too), a folder written by `builder import-hf`, or a Hugging Face model folder. "
        "Tensors must match by name and shape (a task's new head starts fresh).",
    )
    freeze: list[str] = Field(
        default_factory=list,
        description="Parts of the model that do not train, by dotted path: `embedding`, `decoder.layers.0-3` "
        "(indices, both ends included), `decoder.layers.*.attention`; a path may start below the stacks.",
    )
    adapters: dict[str, Any] | None = Field(
        None,
        description="Fine-tune with adapters: laid over the spec's `adapters` (specs/README.md), e.g. {type: lora, "
        "rank: 16, alpha: 32, dropout: 0.05, targets: [q_proj, v_proj] | all-linear, quantize: nf4}. Only the "
        "adapters train; the base (init_from's weights) stays frozen. null: the spec's own (none: full training).",
    )

    @field_validator("freeze")
    @classmethod
    def _freeze_paths(cls, paths):
        for path in paths:
            if not _FREEZE_PATH.fullmatch(path):
                raise ValueError(f"{path!r} is not a dotted path of names, layer indices (3), ranges (0-3) or *")
            for low, high in re.findall(r"(?:^|\.)(\d+)-(\d+)(?=\.|$)", path):
                if int(low) > int(high):
                    raise ValueError(f"{path!r}: the range {low}-{high} runs backwards; write {high}-{low}")
        return paths

    @model_validator(mode="after")
    def _a_model(self):
        if self.spec is None and self.init_from is None:
            raise ValueError("give model.spec (a spec file or mapping) or model.init_from (trained weights), or both")
        return self


#: a recipe's ``optimizer:``: any registered optimizer by its ``type`` (``yamlformer.builder.optim``)
Optimizer = optimizer_field(
    "The optimizer, by its `type`: adamw (the default: every recipe without a type) | muon | sgd | a plugin's."
)


class ScheduleSection(_Section):
    type: Literal["cosine", "inverse_sqrt", "constant", "wsd"] = Field(
        "cosine",
        description="After warmup: cosine to min_lr | inverse_sqrt | constant | wsd (warmup-stable-decay: "
        "constant, then a decay to min_lr over the last steps; a cooldown can branch from any stable checkpoint).",
    )
    warmup_steps: int = Field(100, ge=0, description="Linear warmup from 0 to lr over this many steps.")
    decay_steps: int | None = Field(
        None,
        ge=1,
        description="cosine: the step min_lr is reached (null: trainer.max_steps); wsd: how many final steps decay "
        "(or decay_fraction).",
    )
    decay_fraction: float | None = Field(
        None, gt=0, le=1, description="wsd: the share of trainer.max_steps that decays at the end (null: 0.2)."
    )
    decay_shape: Literal["linear", "cosine", "1-sqrt"] | None = Field(
        None,
        description="wsd: the decay's shape, from lr to min_lr: linear | cosine | 1-sqrt (1 - sqrt(t), Hägele et al. "
        "2024; null: 1-sqrt).",
    )
    min_lr: float = Field(0.0, ge=0, description="The floor of the learning rate.")

    def warnings(self, max_steps: int) -> list[str]:
        """What this schedule does that a run of ``max_steps`` hardly means, one line each (the
        dry run and the run say them; they refuse nothing)."""
        if self.warmup_steps <= max_steps:
            return []
        peak = max_steps / (self.warmup_steps + 1)  # the last step's share of optimizer.lr (lr_multiplier)
        return [
            f"schedule.warmup_steps {self.warmup_steps:,} is more than trainer.max_steps {max_steps:,}: the "
            f"learning rate never reaches optimizer.lr (at most {peak:.0%} of it) and never decays; "
            "lower schedule.warmup_steps"
        ]

    @model_validator(mode="after")
    def _wsd_fields(self):
        if self.type != "wsd":
            for name in ("decay_fraction", "decay_shape"):
                if getattr(self, name) is not None:
                    raise rule_error((name,), f"{name} is a wsd schedule's; this schedule is {self.type}")
        elif self.decay_steps is not None and self.decay_fraction is not None:
            raise rule_error(("decay_fraction",), "give decay_steps or decay_fraction, not both")
        return self


class LossSection(_Section):
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Cross-entropy label smoothing.")
    moe_aux_coef: float = Field(0.01, ge=0, description="Weight of the mixture-of-experts balancing loss.")


#: what ``trainer.devices`` may be, for its one-line refusals
_NOT_DEVICES = "is not a count (3), auto, -1 (every device) or a list of device indices ([0, 1] or '0,1')"


class _TrainingFields(_Section):
    """The trainer fields before its parallelism ones (:class:`TrainerSection` keeps the written order)."""

    max_steps: int = Field(1000, ge=1, description="Optimizer steps to train for.")
    max_time: int | str | None = Field(
        None,
        description="Stop after this long, counted per invocation (a resume gets it again): seconds, or "
        "'HH:MM:SS' / 'DD:HH:MM:SS' (null: no limit).",
    )
    val_check_interval: int = Field(200, ge=1, description="Validate every this many optimizer steps.")
    limit_val_batches: int = Field(20, ge=1, description="Validation micro-batches per check.")
    checkpoint_every_n_steps: int = Field(
        100, ge=1, description="Write last.ckpt every this many steps (and at every validation)."
    )
    keep_every_n_steps: int | None = Field(
        None,
        ge=1,
        description="Also keep a whole, resumable checkpoint branch-N.ckpt every this many steps (null: none); a "
        "cooldown branches from one (builder train RECIPE --cooldown-from CKPT --steps N).",
    )
    gradient_clip_val: float | None = Field(1.0, gt=0, description="Clip the gradient norm (null: off).")
    accumulate_grad_batches: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    precision: Literal["auto", "32", "bf16-mixed", "16-mixed", "bf16-true"] = Field(
        "auto",
        description="auto | 32 | bf16-mixed | 16-mixed | bf16-true. auto: bf16-mixed on a GPU with bf16 and on a "
        "CPU with AMX or AVX512-BF16, else 32 (bf16 emulated on other CPUs is slower than fp32).",
    )
    matmul_precision: Literal["auto", "highest", "high", "medium"] = Field(
        "auto",
        description="float32 matmuls (torch.set_float32_matmul_precision): highest (true fp32) | high (TF32 "
        "on GPUs that have it) | medium (bf16 passes) | auto: high under a mixed or bf16 precision (its few "
        "fp32 matmuls), highest under 32 (the recipe asked for fp32).",
    )
    compile: bool | Literal["model", "layers"] = Field(
        False,
        description="torch.compile: model (the model, the loss and their backward as one graph) | layers "
        "(each Transformer layer, compiled once for all; works with fsdp and activation checkpointing) | "
        "true (layers under fsdp or activation_checkpointing, else model) | false. The compile cache is "
        "kept in <output_dir>/compile-cache, so a resumed run does not compile again.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each layer's activations in the backward pass (less memory)."
    )


class TrainerSection(ParallelismFields, _TrainingFields):
    """How long, where, how precisely: the training fields, the parallelism ones
    (:class:`yamlformer.recipes.recipe.parallelism.ParallelismFields`, with their rules) and the devices."""

    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps", "tpu", "hpu"] = Field(
        "auto", description="auto | cpu | gpu | cuda | mps | tpu | hpu (Lightning's accelerators)."
    )
    devices: int | list[int] | Literal["auto"] = Field(
        "auto",
        description="Devices per node: a count (3), the indices of the devices to use ([0, 1], or '0,1' as "
        "Lightning writes it), auto (every GPU; one process on the CPU) or -1 (every GPU). On the CPU each "
        "device is a process.",
    )
    num_nodes: int = Field(1, ge=1, description="Machines (torchrun / SLURM).")
    seed: int = Field(
        1337,
        ge=0,
        le=2**32 - 1,
        description="Seeds weights, data windows and dropout (0 to 2**32 - 1, as Lightning takes).",
    )
    output_dir: str | None = Field(
        None,
        description="Checkpoints and logs (relative to the working directory; null: runs/<recipe name>).",
        json_schema_extra=WORK_PATH,
    )
    log_every_n_steps: int = Field(10, ge=1, description="Steps between log lines and progress-bar updates.")
    loggers: LoggersSection = Field(
        default_factory=LoggersSection,
        description="Where metrics go: csv and tensorboard (on), wandb and mlflow (each with its options).",
    )

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_str(cls, value):
        return str(value) if isinstance(value, int) else value

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value):
        """``devices`` read once, as Lightning reads it: ``"3"`` is 3, ``"[0, 1]"`` and ``"0,1"`` the
        devices numbered 0 and 1 (a list), ``"-1"`` is -1; ``auto`` stays. Every reader then sees
        a count, a list of indices, ``auto`` or -1 (``yamlformer.recipes.parallel.mesh.device_count``)."""
        shown = repr(value) if isinstance(value, str) else value
        if isinstance(value, str):
            text = value.strip()
            if text == "auto":
                return text
            if re.fullmatch(r"-?\d+", text):
                value = int(text)
            elif re.fullmatch(r"\[\s*\d+(\s*,\s*\d+)*\s*,?\s*\]|\d+(\s*,\s*\d+)*\s*,?", text):
                value = [int(i) for i in re.findall(r"\d+", text)]
            else:
                raise ValueError(f"devices {shown} {_NOT_DEVICES}")
        if isinstance(value, int) and not isinstance(value, bool):
            if value == 0 or value < -1:
                raise ValueError(f"devices {shown}: a count is at least 1 (or -1: every device, or auto)")
            return value
        if not isinstance(value, list):
            raise ValueError(f"devices {shown} {_NOT_DEVICES}")
        if not value or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
            raise ValueError(f"devices {shown}: a list holds device indices 0, 1, ... (at least one)")
        twice = [i for i in value if value.count(i) > 1]
        if twice:
            raise ValueError(f"devices {shown}: device {twice[0]} is listed twice")
        return value

    @field_validator("max_time")
    @classmethod
    def _max_time(cls, value):
        if isinstance(value, str) and not re.fullmatch(r"(\d+:){1,3}\d+", value):
            raise ValueError(f"max_time {value!r} is not seconds or 'HH:MM:SS'")
        return value

    def max_time_delta(self) -> datetime.timedelta | None:
        """``max_time`` as a timedelta (``None`` when unset)."""
        if self.max_time is None:
            return None
        if isinstance(self.max_time, int):
            return datetime.timedelta(seconds=self.max_time)
        parts = [int(p) for p in self.max_time.split(":")]
        parts = [0] * (4 - len(parts)) + parts
        return datetime.timedelta(days=parts[0], hours=parts[1], minutes=parts[2], seconds=parts[3])


class SampleSection(_Section):
    prompts: list[str] = Field(default_factory=lambda: ["\n"], description="Prompts sampled at the end of training.")
    max_new_tokens: int = Field(200, ge=0, description="Tokens generated per prompt.")
    temperature: float = Field(0.8, ge=0, description="0 is greedy.")
    top_k: int | None = Field(200, ge=1, description="Sample among the k likeliest tokens (null: all).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling (null: off).")
    compile: bool = Field(
        False,
        description="Decode with a torch.compile'd one-token step over a static KV cache "
        "(pays off for many tokens from a small model; the first sample pays the compile).",
    )


class Recipe(_Section):
    """A training recipe. Attribute names are the YAML keys."""

    #: how the loader's messages name a file of this kind
    file_kind: ClassVar[str] = "a recipe"
    #: its batches are whole causal windows that ``trainer.context_parallel`` may cut along the
    #: sequence and a pipeline's last stage scores (``yamlformer.recipes.parallel.context``): this
    #: base recipe's are (it is the language model's); a task whose are not says so
    splits_windows: ClassVar[bool] = True

    task: Literal[TASKS] = Field(
        "lm", description=f"{' | '.join(TASKS)}: what is trained (each has its own data section)."
    )
    name: str | None = Field(None, description="Shown in reports and names the output dir (default: file name).")
    model: ModelSection = Field(..., description="The spec to train.")
    data: DataSection = Field(default_factory=DataSection, description="The corpus and its windows.")
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection, description="Text to token ids.")
    optimizer: Optimizer = Field(
        default_factory=AdamWConfig,
        description="The optimizer, by its `type`: adamw (the default) | muon | sgd | a plugin's.",
    )
    schedule: ScheduleSection = Field(default_factory=ScheduleSection, description="Learning-rate schedule.")
    loss: LossSection = Field(default_factory=LossSection, description="The training objective.")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="How long, where, how precisely.")
    sample: SampleSection = Field(default_factory=SampleSection, description="Samples printed at the end.")

    @model_validator(mode="after")
    def _parallelism(self):
        """The parallelism rules that read other sections (``yamlformer.recipes.recipe.parallelism``)."""
        check_recipe_parallelism(self)
        return self


# -- loading -------------------------------------------------------------------------------------


def recipe_path(path: str | Path) -> Path:
    """The recipe file ``path`` names: a path, else a zoo name (``lm-stdlib``)."""

    try:
        return locate(path)
    except ZooError as exc:
        raise RecipeError(f"{path}: {exc}") from None


def read_recipe(path: str | Path, recipe_cls: type[Recipe], overrides: dict[str, Any] | None = None) -> Recipe:
    """A recipe file (or a zoo recipe by name) validated as ``recipe_cls``, its task's schema
    (:func:`yamlformer.recipes.tasks.load_recipe` picks it); raises
    ``yamlformer.builder.spec.loader.SpecError`` with located problems.

    ``--set model.overrides.decoder.n_layers=2`` becomes the spec override ``decoder.n_layers: 2``,
    and so does its shorthand ``--set decoder.n_layers=2``: a key whose first part is not a
    section of the recipe but is a field of a spec (:func:`spec_shorthand`).
    """
    overrides = {key: _from_cwd(key, value) for key, value in spec_shorthand(overrides or {}, recipe_cls).items()}
    model_overrides = {k: v for k, v in overrides.items() if k.startswith("model.overrides.")}
    rest = {k: v for k, v in overrides.items() if k not in model_overrides}
    recipe = load_config(path, recipe_cls, rest, kind="recipe")
    for key, value in model_overrides.items():
        recipe.model.overrides[key.removeprefix("model.overrides.")] = value
    return recipe


#: recipe fields that name files (their sub-fields and items too): relative to the recipe when
#: written in it; given with ``--set``, relative to the working directory when the file is there
PATH_FIELDS = (
    "model.spec",
    "data.sources",
    "data.root",
    "data.train",
    "data.validation",
    "data.file",
    "data.by_label",
    "tokenizer.model_file",
    "classification.init_from",
)


def _from_cwd(key: str, value: Any) -> Any:
    """A ``--set`` value with each relative path of a :data:`PATH_FIELDS` field that exists
    from the working directory made absolute (so it is not read from the recipe's folder)."""
    if isinstance(value, dict):
        return {k: _from_cwd(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_cwd(key, item) for item in value]
    dotted = ".".join(part for part in key.split(".") if not part.lstrip("-").isdigit())
    if (
        isinstance(value, str)
        and value
        and any(dotted == f or dotted.startswith(f + ".") for f in PATH_FIELDS)
        and not Path(value).expanduser().is_absolute()
        and Path(value).exists()
    ):
        return str(Path(value).resolve())
    return value


def spec_shorthand(overrides: dict[str, Any], recipe_cls: type[Recipe]) -> dict[str, Any]:
    """``decoder.n_layers`` -> ``model.overrides.decoder.n_layers``: keys whose first part is a
    spec field and not a recipe section (``name`` stays the recipe's)."""

    out = {}
    for key, value in overrides.items():
        first = key.split(".")[0]
        if first not in recipe_cls.model_fields and first in ModelSpec.model_fields:
            key = f"model.overrides.{key}"
        out[key] = value
    return out


def task_written(written: Document, overrides: dict[str, Any]) -> Any:
    """The ``task:`` a recipe file names (``--set task=...`` first; ``lm`` when it names none),
    as ``written`` (the file as written, :func:`read_written`): any value, which the task's schema
    then checks."""
    data = written.data if isinstance(written.data, dict) else {}
    return overrides.get("task", data.get("task", "lm"))


def read_written(recipe_file: str | Path) -> tuple[Path, Document]:
    """The recipe file ``recipe_file`` names (a path, else a zoo name) and that file as written (its
    ``extends:`` chain merged, no overrides), every key and value located: read once, when the
    recipe is loaded (:class:`yamlformer.recipes.recipe.located.LocatedRecipe` keeps it)."""
    found, _ = locate_file(recipe_file)
    return found, read_merged(found)


def model_spec(
    located,
    vocab_size: int,
    extra: dict[str, Any] | None = None,
    base: tuple[dict[str, Any], str] | None = None,
):
    """The validated model spec of ``located`` (a recipe as loaded:
    :class:`yamlformer.recipes.recipe.located.LocatedRecipe`), with its overrides and the
    tokenizer's ``vocab_size``.

    ``model.overrides`` (dotted keys or nested mappings) are laid over the spec by the loader's
    one merge, located at the recipe's own lines; an inline spec is validated in place, so its
    problems point at the recipe too. ``extra``: overrides a task sets over the recipe's (a
    ``head`` mapping of another type replaces the spec's head). A spec that cannot split
    ``trainer.tensor_parallel`` ways (or whose experts ``trainer.expert_parallel`` ranks cannot
    split) is refused here too, each problem at the line that set the field
    (``yamlformer.builder.analysis.layout.tensor_parallel_problems``, ``expert_parallel_problems``).
    Without ``model.spec`` the spec is ``base``, ``model.init_from``'s spec as data and a label
    (:func:`init_from_spec`), which the caller resolved (``yamlformer.recipes.training.resolved``).
    """

    recipe, doc = located.recipe, located.written
    written = {
        key: (doc, ("model", "overrides", key))
        for key in recipe.model.overrides
        if ("model", "overrides", key) in doc.values
    }
    tokenizer = Mark("<the tokenizer's vocabulary>")  # where vocab_size comes from (no --set of the user's)
    written["vocab_size"] = (Document(vocab_size, {(): tokenizer}, {(): tokenizer}), ())
    overrides = {**recipe.model.overrides, **(extra or {}), "vocab_size": vocab_size}
    if recipe.model.adapters is not None:  # the spec's adapters, located at the recipe's lines
        overrides["adapters"] = recipe.model.adapters
        if ("model", "adapters") in doc.values:
            written["adapters"] = (doc, ("model", "adapters"))
    with _adapters_named_so():
        if isinstance(recipe.model.spec, str):
            path = spec_file(located)
            spec = load_spec(path, overrides=overrides, sources=written)
            _check_layout(spec, recipe, lambda: (read_merged(path, overrides, written), False))
            return spec
        if recipe.model.spec is not None:
            base = None
        elif base is None:
            raise RecipeError("model.spec: none given, and model.init_from was not read")
        spec = _inline_spec(located, overrides, written, base)
        _check_layout(spec, recipe, lambda: (_inline_document(recipe, doc, overrides, written, base), True))
        return spec


@contextlib.contextmanager
def _adapters_named_so():
    """A spec problem in its ``adapters`` named by the recipe field that set it, ``model.adapters``
    (``model.adapters.targets.0: ...``), wherever the spec came from."""
    try:
        yield
    except SpecError as exc:
        renamed = [
            dataclasses.replace(p, path=re.sub(r"^(model\.(spec|init_from)\.)?adapters\b", "model.adapters", p.path))
            for p in exc.problems
        ]
        raise SpecError(renamed) from None


def init_from_spec(source: Source) -> tuple[dict[str, Any], str]:
    """The spec of ``model.init_from`` (its read ``source``) as plain data and a label for where it
    came from (the spec of a recipe that names no ``model.spec`` of its own)."""
    with init_from_errors():
        return spec_base(source.spec_dict(), f"<model.init_from {source.path}>")


def spec_file(located) -> Path:
    """The file ``model.spec`` of ``located`` (a recipe as loaded) names: a path relative to the
    recipe when one is there, else a zoo spec by name (``llama3-8b``); neither is a problem at the
    recipe's ``model.spec`` line."""

    recipe = located.recipe
    try:
        return locate(recipe.model.spec, base=Path(located.file).resolve().parent)
    except ZooError as exc:
        doc = located.written
        written = (doc.data.get("model") or {}).get("spec") if isinstance(doc.data, dict) else None
        where = (doc.value_mark(("model", "spec")) if written == recipe.model.spec else None) or Mark(
            f"<--set model.spec={recipe.model.spec}>"
        )
        raise SpecError([Problem.at(where, "model.spec", str(exc))]) from None


def _check_layout(spec, recipe: Recipe, document) -> None:
    """Located problems of ``spec`` under the recipe's tensor- and expert-parallel degrees; ``document()``:
    ``(the spec's merged document, whether it is inline in the recipe)``."""
    # local: builder validate loads this module for every file; the layout's rules load when a recipe's spec is checked
    from yamlformer.builder.analysis.layout import expert_parallel_problems, tensor_parallel_problems

    problems = tensor_parallel_problems(spec, recipe.trainer.tensor_parallel)
    problems += expert_parallel_problems(spec, recipe.trainer.expert_parallel)
    if problems:
        doc, inline = document()
        located = [locate_problem(doc, loc, message) for loc, message in problems]
        raise SpecError(_under_recipe(located) if inline else located)


def _marked(data: Any, path: tuple, mark, marks: dict) -> None:
    marks[path] = mark
    if isinstance(data, dict):
        for key, value in data.items():
            _marked(value, path + (key,), mark, marks)


def _inline_document(
    recipe: Recipe, doc, overrides: dict[str, Any], written: dict, base: tuple[dict, str] | None = None
):
    """The recipe's inline spec, or ``base`` (a spec as data and a label for where it came from),
    with the overrides laid over it, as a located document."""

    prefix = ("model", "spec")
    if base is not None:
        marks: dict = {}
        _marked(base[0], (), Mark(base[1]), marks)
        inline = Document(data=copy.deepcopy(base[0]), keys=dict(marks), values=marks)
    else:
        inline = Document(
            data=copy.deepcopy(recipe.model.spec),
            keys={k[2:]: m for k, m in doc.keys.items() if k[:2] == prefix},
            values={k[2:]: m for k, m in doc.values.items() if k[:2] == prefix},
        )
    if "extends" in inline.data:
        where = inline.value_mark(("extends",))
        raise SpecError([Problem.at(where, "model.spec.extends", "an inline spec cannot extend; give `spec:` a file")])
    try:
        apply_overrides(inline, overrides, written)
    except SpecError as exc:
        raise SpecError(_under_recipe(exc.problems, "model.spec" if base is None else "model.init_from")) from None
    return inline


def _inline_spec(located, overrides: dict[str, Any], written: dict, base: tuple[dict, str] | None = None):
    inline = _inline_document(located.recipe, located.written, overrides, written, base)
    try:
        return validate_document(inline, spec_model(), str(located.file))
    except SpecError as exc:
        raise SpecError(_under_recipe(exc.problems, "model.spec" if base is None else "model.init_from")) from None


def _under_recipe(problems: list, where: str = "model.spec") -> list:
    """Problems of an inline spec re-pathed under the recipe: decoder.n_layers -> model.spec.decoder.n_layers
    (``model.init_from`` for the spec a run starts from)."""
    return [dataclasses.replace(p, path=".".join(filter(None, (where, p.path)))) for p in problems]
