"""What the recipes' runtime can run: the one table the planner and the runtime's refusals read (torch-free).

The recipes train a layout through their ``trainer`` fields (``strategy``, ``data_parallel``,
``tensor_parallel``, ``context_parallel``, ``expert_parallel``, ``pipeline_parallel``,
``pipeline_schedule``, ``microbatches``, ``accumulate_grad_batches``, ``activation_checkpointing``,
``devices``, ``num_nodes``). Recipes import builder and not the reverse, so the rules on which
combinations of them the runtime runs are declared here, once: :data:`RULES`, each naming the
trainer field at fault and why. The recipes' trainer validation raises the first of
:func:`problems` (a located ``rule_error`` on its field); ``builder plan --launchable`` searches
only layouts with none (:func:`launch_problems`, which adds what the performance model sizes but
the runtime does not run: selective recomputation, sequence-parallel tensor parallelism) and
writes a chosen layout's fields with :func:`launch_fields`.

What a spec itself cannot split (head counts, experts kept as separate modules, too few layers)
is each block's own contract, read through ``yamlformer.builder.analysis.layout_rules``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

#: the pipeline schedules, as ``trainer.pipeline_schedule`` names them (torch.distributed.pipelining)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
#: the performance model's schedule names (``yamlformer.builder.analysis.perf.SCHEDULES``) as the runtime's
SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "interleaved_1f1b", "zero-bubble": "zbv"}
#: the runtime's virtual stages per rank of an interleaved schedule
INTERLEAVED_STAGES = 2
#: the V-shaped schedules and their stages per rank (rank r holds stages r and 2P - 1 - r)
V_SCHEDULES = ("zbv", "dualpipev")
V_STAGES = 2


def stage_placement(schedule: str) -> tuple[int, str]:
    """``(stages per rank, placement)`` of a schedule, by its runtime or performance-model name:
    interleaved 1F1B loops :data:`INTERLEAVED_STAGES` per rank (rank r: stages r, r + P, ...);
    the runtime's zbv and dualpipev place :data:`V_STAGES` in a V (rank r: stages r and 2P - 1 - r,
    so rank 0 holds the embedding and the head); the others, and the performance model's
    zero-bubble (ZB-H1, as ``builder plan`` sizes it), one stage per rank."""
    if schedule in ("interleaved-1f1b", "interleaved_1f1b"):
        return INTERLEAVED_STAGES, "loop"
    if schedule in V_SCHEDULES:
        return V_STAGES, "v"
    return 1, "loop"


#: the recomputation the runtime runs, as ``trainer.activation_checkpointing`` says it (every layer or none)
CHECKPOINTING = {"none": False, "full": True}


@dataclass(frozen=True)
class Settings:
    """The trainer fields the rules read, named as the recipes' ``trainer`` section names them;
    ``devices``: per node, a count, a list of device indices or ``auto`` (unknown: rules on it pass)."""

    strategy: str = "fsdp"
    data_parallel: str = "shard"
    tensor_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    microbatches: int | None = None
    accumulate_grad_batches: int = 1
    devices: Any = "auto"
    num_nodes: int = 1

    @classmethod
    def of(cls, section) -> Settings:
        """The settings of any object with these attributes (a recipe's ``trainer`` section); one it
        lacks takes its default (a runtime without pipeline fields runs no pipeline)."""

        return cls(**{f.name: getattr(section, f.name) for f in fields(cls) if hasattr(section, f.name)})

    @property
    def per_node(self) -> int | None:
        """Devices per node when the settings say (None for ``auto`` and ``-1``)."""
        if isinstance(self.devices, list):
            return len(self.devices)
        return self.devices if isinstance(self.devices, int) and self.devices > 0 else None

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches one pipelined step cuts its batch into (``microbatches``, default the stages)."""
        return self.microbatches or self.pipeline_parallel


@dataclass(frozen=True)
class Rule:
    """The runtime refuses settings for which ``refuses`` holds; ``field``: the trainer field at fault."""

    field: str
    refuses: Callable[[Settings], bool]
    reason: Callable[[Settings], str]


def _divides(s: Settings, degree: int) -> bool:
    return s.per_node is None or s.per_node % degree == 0


#: every combination the runtime refuses, in the order it checks them
RULES: tuple[Rule, ...] = (
    *(
        Rule(
            name,
            lambda s, name=name: s.strategy != "fsdp" and getattr(s, name) > 1,
            lambda s, name=name, why=why: f"{name} needs strategy: fsdp ({why})",
        )
        for name, why in (
            ("tensor_parallel", "FSDP2 composes with it on a 2-D device mesh"),
            ("context_parallel", "its ranks join FSDP2's shard group on the device mesh"),
            ("expert_parallel", "the experts are split over FSDP2's shard group"),
            ("pipeline_parallel", "stages on a device mesh"),
        )
    ),
    Rule(
        "data_parallel",
        lambda s: s.strategy != "fsdp" and s.data_parallel != "shard",
        lambda s: f"data_parallel {s.data_parallel} needs strategy: fsdp",
    ),
    Rule(
        "microbatches",
        lambda s: s.pipeline_parallel == 1 and s.microbatches is not None,
        lambda s: "microbatches needs pipeline_parallel > 1",
    ),
    Rule(
        "data_parallel",
        lambda s: s.data_parallel == "hybrid" and s.num_nodes == 1,
        lambda s: (
            "data_parallel hybrid shards inside a node and replicates across nodes, but num_nodes is 1; "
            "use shard (or set num_nodes)"
        ),
    ),
    Rule(
        "tensor_parallel",
        lambda s: not _divides(s, s.tensor_parallel),
        lambda s: (
            f"tensor_parallel {s.tensor_parallel} must divide devices ({s.per_node} per node): a "
            "tensor-parallel group stays inside one node"
        ),
    ),
    Rule(
        "context_parallel",
        lambda s: not _divides(s, s.tensor_parallel * s.context_parallel),
        lambda s: (
            f"tensor_parallel x context_parallel ({s.tensor_parallel} x {s.context_parallel}) must divide "
            f"devices ({s.per_node} per node): a context-parallel group stays inside one node"
        ),
    ),
    Rule(
        "expert_parallel",
        lambda s: s.expert_parallel > 1 and s.data_parallel == "replicate",
        lambda s: (
            "expert_parallel borrows its ranks from the FSDP shard group, which data_parallel replicate "
            "does not have; use shard or hybrid"
        ),
    ),
    Rule(
        "expert_parallel",
        lambda s: s.expert_parallel > 1 and s.context_parallel > 1 and s.expert_parallel % s.context_parallel,
        lambda s: (
            f"expert_parallel {s.expert_parallel} with context_parallel {s.context_parallel}: the expert group "
            "takes every context-parallel rank of the FSDP shard group first (as torchtitan), so it must be a "
            "multiple of context_parallel"
        ),
    ),
    Rule(
        "accumulate_grad_batches",
        lambda s: s.pipeline_parallel > 1 and s.accumulate_grad_batches > 1,
        lambda s: (
            "accumulate_grad_batches > 1 with pipeline_parallel: the schedule accumulates its "
            "micro-batches itself; raise data.batch_size and trainer.microbatches instead"
        ),
    ),
    Rule(
        "pipeline_parallel",
        lambda s: (
            s.pipeline_parallel > 1 and s.per_node is not None and (s.per_node * s.num_nodes) % s.pipeline_parallel != 0
        ),
        lambda s: f"pipeline_parallel {s.pipeline_parallel} must divide the {(s.per_node or 0) * s.num_nodes} devices",
    ),
    Rule(
        "microbatches",
        lambda s: (
            s.pipeline_parallel > 1
            and s.pipeline_schedule == "dualpipev"
            and s.pipeline_microbatches < V_STAGES * s.pipeline_parallel
        ),
        lambda s: (
            f"dualpipev needs at least as many micro-batches as stages: {s.pipeline_microbatches} for "
            f"{V_STAGES * s.pipeline_parallel} ({V_STAGES} per rank); raise trainer.microbatches"
        ),
    ),
    Rule(
        "microbatches",
        lambda s: (
            s.pipeline_parallel > 1
            and s.pipeline_schedule == "interleaved_1f1b"
            and s.pipeline_microbatches % max(1, s.pipeline_microbatches // s.pipeline_parallel) != 0
        ),
        lambda s: (
            f"interleaved_1f1b needs micro-batches ({s.pipeline_microbatches}) in whole rounds of "
            f"{s.pipeline_parallel} (the stages)"
        ),
    ),
)


def problems(settings: Settings) -> list[tuple[str, str]]:
    """``(trainer field, reason)`` of every rule ``settings`` break, in :data:`RULES`' order."""
    return [(rule.field, rule.reason(settings)) for rule in RULES if rule.refuses(settings)]


# -- a plan's layout as the runtime runs it --------------------------------------------------------


def settings_of(layout, *, schedule: str = "1f1b", microbatches: int = 1) -> Settings:
    """The trainer settings that run ``layout`` (a ``yamlformer.builder.analysis.layout.Layout``) with the
    performance model's ``schedule`` and ``microbatches`` micro-batches per optimizer step of a
    data-parallel rank: the pipeline's own under pipeline parallelism, else accumulation steps."""
    piped = layout.pipeline_parallel > 1
    return Settings(
        strategy="fsdp",
        data_parallel=layout.data_parallel,
        tensor_parallel=layout.tensor_parallel,
        context_parallel=layout.context_parallel,
        expert_parallel=layout.expert_parallel,
        pipeline_parallel=layout.pipeline_parallel,
        pipeline_schedule=SCHEDULE_NAMES.get(schedule, schedule) if piped else "1f1b",
        microbatches=microbatches if piped else None,
        accumulate_grad_batches=1 if piped else microbatches,
        devices=layout.per_node,
        num_nodes=layout.nodes,
    )


def launch_problems(
    layout,
    *,
    recompute: str,
    schedule: str = "1f1b",
    microbatches: int = 1,
    sequence_parallel: bool = False,
    context_gather: bool = True,
) -> list[tuple[str, str]]:
    """``(trainer field, reason)`` for everything about a planned step the runtime does not run:
    :func:`problems` of its :func:`settings_of`, and the performance model's options the runtime
    lacks (selective recomputation; tensor parallelism sized sequence-parallel, which the recipes'
    tensor parallelism, keeping the layers' inputs and logits whole, is not; context parallelism
    sized as ring attention, where the recipes' all-gathers the keys and values)."""
    out = []
    if recompute not in CHECKPOINTING:
        out.append(
            ("activation_checkpointing", f"recomputation {recompute}: the runtime recomputes every layer or none")
        )
    if sequence_parallel and layout.tensor_parallel > 1:
        out.append(
            (
                "tensor_parallel",
                f"tensor_parallel {layout.tensor_parallel} sized sequence-parallel; the recipes' tensor "
                "parallelism keeps the layers' inputs and logits whole",
            )
        )
    if not context_gather and layout.context_parallel > 1:
        out.append(
            (
                "context_parallel",
                f"context_parallel {layout.context_parallel} sized as ring attention; the recipes' context "
                "parallelism all-gathers every rank's keys and values",
            )
        )
    if layout.pipeline_parallel > 1 and schedule not in SCHEDULE_NAMES:
        out.append(("pipeline_schedule", f"pipeline_schedule {schedule}: not one the runtime names"))
    return out + problems(settings_of(layout, schedule=schedule, microbatches=microbatches))


def launch_fields(layout, *, recompute: str, schedule: str = "1f1b", microbatches: int = 1) -> dict[str, Any]:
    """The trainer fields a launch of ``layout`` sets, by name: the strategy, data-parallel mode,
    degrees and recomputation, and the accumulation; the context-, expert- and pipeline-parallel
    fields only when their degree is more than 1 (so a runtime without them takes the rest)."""
    s = settings_of(layout, schedule=schedule, microbatches=microbatches)
    out: dict[str, Any] = {
        "accumulate_grad_batches": s.accumulate_grad_batches,
        "activation_checkpointing": CHECKPOINTING[recompute],
        "strategy": s.strategy,
        "tensor_parallel": s.tensor_parallel,
        "data_parallel": s.data_parallel,
    }
    for name in ("context_parallel", "expert_parallel"):
        if getattr(s, name) > 1:
            out[name] = getattr(s, name)
    if s.pipeline_parallel > 1:
        out.update(
            pipeline_parallel=s.pipeline_parallel, pipeline_schedule=s.pipeline_schedule, microbatches=s.microbatches
        )
    return out
