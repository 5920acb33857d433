"""``task: preference``: preference tuning of a causal LM on pairs of a chosen and a rejected
answer to one prompt (DPO, IPO, SimPO, ORPO: ``yamlformer.recipes.tasks.preference.losses``), the
pairs rendered with the chat template and packed into rows as SFT's records are
(``yamlformer.recipes.data.pairs``); usually after SFT (``model.init_from``), with adapters or
not. DPO and IPO compare with a reference model, the starting policy: with adapters, the policy
with its adapters switched off or their starting values swapped in (no second copy of the model);
without, a frozen copy of the starting weights, which the estimates count. Held-out pairs are
scored before and after. This module (torch-free) is its recipe schema and
:class:`~yamlformer.recipes.tasks.task.Task`; ``training.py`` reads, trains and scores."""

from __future__ import annotations

import functools
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from yamlformer.builder.spec.problems import rule_error
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import _Section
from yamlformer.recipes.recipe.sections import Recipe
from yamlformer.recipes.tasks.sft import (
    InstructionDataSection,
    InstructionResolution,
    InstructionTuning,
    held_out_file,
    training_file,
)
from yamlformer.recipes.tasks.task import scored

#: the losses, and which of them compare against a reference model (``losses.NEEDS_REFERENCE``)
LOSSES = ("dpo", "ipo", "simpo", "orpo")
REFERENCED = ("dpo", "ipo")
#: each option and the losses that read it
OPTIONS = {"label_smoothing": ("dpo", "simpo"), "simpo_gamma": ("simpo",), "orpo_lambda": ("orpo",)}


class PairDataSection(InstructionDataSection):
    file: str | None = training_file(
        'Training pairs: a .jsonl (.gz, .zst) or .parquet file of {"prompt", "chosen", "rejected"} (and "system") '
        'records, strings or message lists, or {"chosen", "rejected"} whole conversations sharing their prompt'
    )
    validation: str | None = held_out_file("pairs")
    seq_len: int = Field(
        512,
        ge=2,
        description="Tokens per row; a pair's chosen and rejected sequences (each its prompt and answer) share "
        "a row of seq_len + 1 tokens, and a pair longer than that is refused.",
    )
    batch_size: int = Field(8, ge=1, description="Rows per micro-batch on each device (each row whole pairs).")
    packing: bool = Field(
        True, description="Pack several pairs into a row, attention masked between sequences (false: one pair a row)."
    )


class PreferenceSection(_Section):
    loss: Literal[LOSSES] = Field(
        "dpo",
        description="dpo (a reference model) | ipo (a reference model; length-normalised) | simpo (no reference) | "
        "orpo (no reference; the chosen answers' NLL plus an odds-ratio term). Defined as TRL defines them.",
    )
    beta: float = Field(
        0.1,
        gt=0,
        description="dpo, ipo, simpo: the temperature (TRL's beta; ipo's regularisation tau). Rewards are beta times "
        "the log-ratios (simpo: the mean token log-probabilities).",
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="dpo, simpo: the share of pairs taken as mislabelled (cDPO's epsilon)."
    )
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: the target reward margin gamma (TRL's simpo_gamma).")
    orpo_lambda: float = Field(
        0.1, gt=0, description="orpo: the weight of the odds-ratio term (the paper's lambda; TRL's ORPOConfig.beta)."
    )

    precompute_reference: bool = Field(
        False,
        description="dpo, ipo: the reference's log-probabilities of every pair computed in one pass before training "
        "(the starting weights, in eval mode, fp32, where the model is built) and cached under data.cache_dir, "
        "keyed by a fingerprint of the encoded pairs and those weights; training then keeps no reference model "
        "(no frozen copy, no adapters switched off) and the estimates count none.",
    )

    @model_validator(mode="after")
    def _options_of_the_loss(self):
        for option, losses in OPTIONS.items():  # a default written out (a run's config.yaml) says nothing
            changed = getattr(self, option) != type(self).model_fields[option].default
            if option in self.model_fields_set and changed and self.loss not in losses:
                raise rule_error(
                    (option,), f"loss {self.loss} does not read {option} (it applies to {', '.join(losses)})"
                )
        if self.precompute_reference and self.loss not in REFERENCED:
            raise rule_error(
                ("precompute_reference",), f"loss {self.loss} has no reference model (dpo and ipo have one)"
            )
        return self

    def needs_reference(self) -> bool:
        return self.loss in REFERENCED


class PreferenceRecipe(Recipe):
    """``task: preference``: a causal LM tuned on preference pairs."""

    splits_windows: ClassVar[bool] = False  # its rows are pairs, whole: not cut along the sequence or pipelined

    task: Literal["preference"] = Field("preference", description="preference.")
    data: PairDataSection = Field(..., description="The pairs, their template and rows.")
    preference: PreferenceSection = Field(default_factory=PreferenceSection, description="The loss and its options.")

    @model_validator(mode="after")
    def _no_cross_entropy_options(self):
        if self.loss.label_smoothing:
            raise rule_error(
                ("loss", "label_smoothing"),
                "task preference has no cross-entropy to smooth; see preference.label_smoothing",
            )
        return self


class PreferenceResolution(InstructionResolution):
    """SFT's data files and spec checks (the same chat records' rows, the same causal LM); its
    own pairs, rows and reference model."""

    def conversations(self):
        # local: the data side loads when data is read (this module is torch-free)
        from yamlformer.recipes.data.pairs import pair_sides

        return pair_sides

    def check_data(self, vocab_size: int, pretrained: dict | None) -> None:
        """Not sft's record check: a pair is encoded by :mod:`yamlformer.recipes.data.pairs`, which
        the run alone reads so far (the dry run checks that the files are there)."""

    def batch_shape(self, spec) -> tuple[int, int, str]:
        data = self.recipe.data
        packed = "pairs packed" if data.packing else "a pair each"
        return data.seq_len, data.batch_size, f"{data.batch_size} rows x {data.seq_len} tokens ({packed})"

    def reference_copy(self, spec) -> bool:
        objective = self.recipe.preference
        return objective.needs_reference() and not objective.precompute_reference and spec.adapters is None

    def check_spec(self, spec) -> None:
        if spec.architecture_config.decoding_stack() is None or spec.architecture != "decoder-only":
            raise RecipeError(f"task preference trains a decoder-only model; the spec is {spec.architecture}")
        super().check_spec(spec)

    @functools.cached_property
    def dry_run_lines(self) -> tuple[tuple[str, str], ...]:
        recipe = self.recipe
        objective = recipe.preference
        if not objective.needs_reference():
            how = "none (the loss reads the policy alone)"
        elif objective.precompute_reference:
            how = (
                "precomputed: the starting weights' log-probabilities of every pair, one pass before training, "
                f"cached under {recipe.data.cache_dir}/reference-logps (no reference model in memory)"
            )
        elif recipe.model.adapters is not None:
            how = (
                "the starting policy: its adapters switched off if they start fresh, else their starting "
                "values swapped in (a copy of the adapters alone)"
            )
        else:
            how = "a frozen copy of the starting weights (counted in the memory estimate)"
        return (("preference", f"loss {objective.loss}, beta {objective.beta}; reference model: {how}"),)


class PreferenceTuning(InstructionTuning):
    """SFT's decoding (the same causal LM); its own training, reference model and scores."""

    name = "preference"
    recipe = PreferenceRecipe
    resolution = PreferenceResolution

    def prepare(self, run, samples: bool):
        # local: the training side imports torch and Lightning (this module is torch-free)
        from yamlformer.recipes.tasks.preference.training import prepare

        return prepare(run)

    def evaluate(self, model, tokenizer, meta: dict, args) -> dict:
        # local: the training side imports torch and Lightning (this module is torch-free)
        from yamlformer.recipes.tasks.preference.training import evaluate_checkpoint

        self.check_meta(meta)
        return evaluate_checkpoint(model, tokenizer, meta, args)

    def print_evaluation(self, result: dict, args) -> None:
        # local: evaluate loaded the training side (torch) already; this module is torch-free
        from yamlformer.recipes.tasks.preference.training import scores_line

        where = f"{result['checkpoint']} (step {result['step']}) on {result['pairs']:,} held-out pairs"
        print(f"{where}: {scores_line(result)}")
        print(scored(result["batches"], result["batches_available"], args))


TASK = PreferenceTuning()
