"""The trainer's parallelism: the fields that lay a run out over devices (``strategy``,
``data_parallel`` and the tensor-, pipeline-, context- and expert-parallel degrees) and their
rules, each refusal one located line naming the field. Torch-free.

:class:`ParallelismFields` is the part of ``trainer`` (:class:`yamlformer.recipes.recipe.sections.TrainerSection`
adds the rest, which these rules also read: ``devices``, ``num_nodes``, ``precision``, ``compile``,
``accumulate_grad_batches``); :func:`check_recipe_parallelism` holds the rules that read other
sections (the task, ``data.seq_len``, ``data.packing``, ``data.batch_size``). Which layouts can
run at all is :class:`yamlformer.builder.analysis.layout.Layout`'s (``yamlformer.recipes.parallel.mesh.layout_of``); the
combinations the runtime cannot lay out (``yamlformer.builder.analysis.runtime``'s table) are refused here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from yamlformer.builder.spec.problems import rule_error
from yamlformer.recipes.fields import _Section

#: the pipeline schedules (``torch.distributed.pipelining.schedules``), as ``trainer.pipeline_schedule`` names them
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]


class ParallelismFields(_Section):
    """The parallelism fields of ``trainer`` and their rules (module doc)."""

    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="auto | ddp | fsdp. fsdp is FSDP2 (fully_shard) through Lightning's ModelParallelStrategy: "
        "one shard unit per layer plus the embedding and the head, started on the meta device, sharded "
        "checkpoints; CPU (gloo) or CUDA (nccl).",
    )
    data_parallel: Literal["shard", "replicate", "hybrid"] = Field(
        "shard",
        description="fsdp: shard (parameters, gradients and optimizer state split over the data-parallel "
        "ranks) | replicate (every rank keeps everything, gradients all-reduced) | hybrid (HSDP: shard "
        "inside a node, replicate across nodes).",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="fsdp: tensor-parallel degree (ranks of one node that split every layer's matrices, "
        "as each block's parallel plan declares); the data-parallel degree is the rest.",
    )
    pipeline_parallel: int = Field(
        1,
        ge=1,
        description="fsdp: pipeline stages (torch.distributed.pipelining), each holding consecutive layers "
        "(the first the embedding, the last the final norm and head); the data-parallel degree is the rest.",
    )
    pipeline_schedule: PipelineSchedule = Field(
        "1f1b",
        description="pipeline_parallel > 1: gpipe | 1f1b | interleaved_1f1b (2 stages per rank) | zbv (zero "
        "bubble, Qi et al.) | dualpipev (DeepSeek's DualPipe, at least 2 x pipeline_parallel micro-batches); "
        "zbv and dualpipev place 2 stages per rank in a V and split each backward into input and weight parts.",
    )
    microbatches: int | None = Field(
        None,
        ge=1,
        description="pipeline_parallel > 1: micro-batches each data.batch_size is cut into for the pipeline "
        "schedule (it must divide data.batch_size; null: the number of stages).",
    )
    context_parallel: int = Field(
        1,
        ge=1,
        description="fsdp: context-parallel degree (ranks that split every sequence, in 2 x C load-balanced "
        "chunks, each attending over the keys gathered from all; they read the same micro-batch); "
        "data.seq_len must divide into 2 x C chunks. lm task, multi_head attention.",
    )
    expert_parallel: int = Field(
        1,
        ge=1,
        description="fsdp: expert-parallel degree (ranks of the FSDP shard group that split every "
        "mixture of experts' routed experts, tokens sent to them by all-to-all); borrowed from the "
        "data-parallel ranks, so data.batch_size stays per data-parallel rank; with context_parallel a "
        "multiple of it (the expert group takes the context-parallel ranks first).",
    )

    @model_validator(mode="after")
    def _layout(self):
        """The combinations of these fields the runtime refuses are ``yamlformer.builder.analysis.runtime``'s
        table (which ``builder plan --launchable`` reads too): the first one broken, located at
        its field. The precision and compile rules under fsdp are this section's own."""
        # local: builder validate loads this module for every file; the runtime's rules load when a recipe is checked
        from yamlformer.builder.analysis.runtime import Settings, problems

        found = problems(Settings.of(self))
        if found:
            field, reason = found[0]
            raise rule_error((field,), reason)
        if self.strategy != "fsdp":
            return self
        if self.precision == "16-mixed":
            raise rule_error(("precision",), "precision 16-mixed is not supported with strategy fsdp; use bf16-mixed")
        if self.compile == "model":
            raise rule_error(
                ("compile",),
                "compile: model traces the whole step, which FSDP2's per-layer hooks "
                "split; with strategy fsdp use layers (or true)",
            )
        return self

    def pipeline_microbatches(self) -> int:
        """The micro-batches a pipelined step cuts its batch into (``microbatches``, default the stages)."""
        return self.microbatches or self.pipeline_parallel


def check_recipe_parallelism(recipe) -> None:
    """The parallelism rules that read sections beside ``trainer`` (a :class:`Recipe`'s validator calls it)."""
    _context_parallel(recipe)
    _pipeline_batch(recipe)
    _quantized_base(recipe)


def _context_parallel(recipe) -> None:
    """``trainer.context_parallel`` splits an LM window of ``data.seq_len`` tokens in ``2 x C``
    equal chunks (``yamlformer.recipes.parallel.context``); whole windows only, no packed documents."""

    degree = recipe.trainer.context_parallel
    if degree == 1:
        return
    if not type(recipe).splits_windows:
        raise rule_error(("trainer", "context_parallel"), f"context_parallel splits LM windows; task {recipe.task}")
    if recipe.data.seq_len % (2 * degree):
        raise rule_error(
            ("data", "seq_len"),
            f"seq_len {recipe.data.seq_len} does not split into 2 x {degree} equal chunks (trainer.context_parallel)",
        )
    if recipe.data.packing != "concat":
        raise rule_error(
            ("data", "packing"),
            f"packing {recipe.data.packing} masks across documents, which a context-parallel share does "
            "not (trainer.context_parallel); use concat",
        )


def _pipeline_batch(recipe) -> None:
    """``trainer.pipeline_parallel`` trains LM windows (its last stage computes their next-token
    loss), without packed documents' ids, in micro-batches that divide ``data.batch_size``."""

    trainer = recipe.trainer
    if trainer.pipeline_parallel == 1:
        return
    if not type(recipe).splits_windows:  # the last stage's loss: next tokens of whole windows
        raise rule_error(
            ("trainer", "pipeline_parallel"),
            f"pipeline_parallel trains next-token prediction over LM windows; task {recipe.task}'s loss is "
            "not pipelined",
        )
    if getattr(recipe.data, "packing", None) == "doc_masked":
        raise rule_error(
            ("data", "packing"),
            "packing doc_masked with pipeline_parallel: later stages see hidden states only, not the "
            "document ids; use concat",
        )
    micro, batch = trainer.pipeline_microbatches(), recipe.data.batch_size
    if batch % micro:
        raise rule_error(
            ("trainer", "microbatches") if trainer.microbatches else ("data", "batch_size"),
            f"{micro} pipeline micro-batches must divide data.batch_size {batch}",
        )


def _quantized_base(recipe) -> None:
    """``model.adapters.quantize: nf4`` (QLoRA) trains on one process or under DDP: the NF4 base is
    not sharded by FSDP2 or split by tensor parallelism here (untested on their meshes)."""
    adapters = recipe.model.adapters
    if isinstance(adapters, dict) and adapters.get("quantize") and recipe.trainer.strategy == "fsdp":
        raise rule_error(
            ("model", "adapters", "quantize"),
            "an NF4 base (QLoRA) trains on one device or with strategy ddp; strategy fsdp (FSDP2, tensor "
            "parallelism) does not shard it here",
        )
