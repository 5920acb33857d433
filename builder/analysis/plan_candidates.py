"""What the launch planner (:mod:`yamlformer.builder.analysis.plan`) finds and how it ranks it,
torch-free: a :class:`Candidate` (one layout's prediction, its ranking key, what the recipes'
runtime would refuse of it, its summary), the :class:`Plan` a search returns (the chosen layout,
the alternatives, the FSDP-only baseline, why layouts were left out), and the :class:`Pins` a
caller fixes. The search itself, and what would fit when nothing does, are the planner's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from yamlformer.builder.analysis import runtime
from yamlformer.builder.analysis.hardware import Cluster
from yamlformer.builder.analysis.layout import Layout
from yamlformer.builder.analysis.perf import Calibration, Prediction, Run

CHEAPEST = (
    "ranked by predicted step time (yamlformer.builder.analysis.perf: compute, memory-bound work, exposed "
    "communication, pipeline bubble, optimizer step); within 0.5% a tie, which goes to the "
    "smallest tensor-parallel degree, the fewest pipeline stages, the least context and expert "
    "parallelism, then hybrid, replicate, shard (fewest bytes between nodes), then the largest "
    "micro-batch, then the least memory per GPU"
)
#: predicted times this close (relatively) rank as a tie, which the simpler layout wins
TIE = 0.005
#: tie order of the data-parallel modes (fewest bytes between nodes first)
DP_ORDER = {"hybrid": 0, "replicate": 1, "shard": 2}


@dataclass(frozen=True)
class Candidate:
    prediction: Prediction
    rank_by: str = "time"
    #: ``(trainer field, reason)`` for what the spec's blocks cannot run in this layout as the
    #: recipes run it (:func:`block_problems`)
    blocked: tuple[tuple[str, str], ...] = ()
    #: the vocabulary padding the planner gave the spec so its tensor-parallel ranks split it
    #: (``yamlformer.builder.analysis.layout_rules.padded_for``: Megatron-LM's 128 x TP); None: as the spec is
    padded: tuple[int, int] | None = None  # (pad_vocab_to_multiple_of, padded rows)

    @property
    def spec_overrides(self) -> tuple[str, ...]:
        """The spec settings (``--set``) this candidate runs with beyond the spec's own."""
        return (f"pad_vocab_to_multiple_of={self.padded[0]}",) if self.padded else ()

    @property
    def layout(self) -> Layout:
        return self.prediction.layout

    @property
    def run(self) -> Run:
        return self.prediction.run

    @property
    def micro_batch(self) -> int:
        return self.run.micro_batch

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step of one data-parallel rank (the pipeline's, under PP)."""
        return self.prediction.microbatches

    @property
    def recompute(self) -> str:
        return self.run.recompute

    @property
    def checkpointing(self) -> bool:
        """Every layer recomputed (what a recipe's ``activation_checkpointing`` switches on)."""
        return self.run.recompute == "full"

    @property
    def memory(self) -> int:
        return self.prediction.memory_per_gpu_bytes

    @property
    def step_seconds(self) -> float:
        return self.prediction.step_s

    @property
    def gpu_hours(self) -> float:
        return self.layout.devices * self.step_seconds / 3600

    def key(self) -> tuple:
        value = self.gpu_hours if self.rank_by == "cost" else self.step_seconds
        return (
            math.floor(math.log(value) / math.log1p(TIE)) if value > 0 else -math.inf,  # within TIE: a tie
            self.layout.tensor_parallel,
            self.layout.pipeline_parallel,
            self.layout.context_parallel,
            self.layout.expert_parallel,
            DP_ORDER[self.layout.data_parallel],
            -self.micro_batch,
            self.memory,
        )

    def launch_problems(self) -> list[tuple[str, str]]:
        """``(trainer field, reason)`` for each thing about this step the recipes' runtime does not
        run (``yamlformer.builder.analysis.runtime.launch_problems``); ``[]``: it launches."""
        return list(self.blocked) + runtime.launch_problems(
            self.layout,
            recompute=self.recompute,
            schedule=self.run.schedule,
            microbatches=self.accumulation,
            sequence_parallel=self.run.sequence_parallel,
            context_gather=self.run.context_gather,
        )

    def summary(self) -> str:
        run = self.run
        schedule = f"; {run.schedule} schedule" if self.layout.pipeline_parallel > 1 else ""
        pad = self.padded
        padded = f"; the vocabulary padded to {pad[1]:,} (Megatron-LM's 128 x TP: {pad[0]})" if pad else ""
        return (
            f"{self.layout.describe()}; micro-batch {self.micro_batch} x {self.accumulation} "
            f"{'pipeline micro-batches' if self.layout.pipeline_parallel > 1 else 'accumulation steps'}"
            f"; recomputation {run.recompute}{schedule}{padded}"
        )

    def to_dict(self) -> dict[str, Any]:
        p = self.prediction
        return {
            **p.to_dict(),
            "micro_batch": self.micro_batch,
            "accumulate_grad_batches": self.accumulation,
            "checkpointing": self.recompute,
            "activation_checkpointing": self.checkpointing,
            "memory": self.memory,
            "step_seconds": self.step_seconds,
            "gpu_hours_per_step": self.gpu_hours,
            "spec_overrides": list(self.spec_overrides),
            "summary": self.summary(),
        }


@dataclass
class Plan:
    spec_name: str
    cluster: Cluster
    seq_len: int
    src_len: int | None
    global_batch: int
    dtype: str
    chosen: Candidate | None
    alternatives: list[Candidate] = field(default_factory=list)
    considered: int = 0
    fitting: int = 0
    reasons: list[str] = field(default_factory=list)  # why layouts were left out or nothing fits
    would_fit: list[str] = field(default_factory=list)
    calibration: Calibration | None = None
    params: int = 0
    #: the fastest FSDP-only layout (no tensor, pipeline, context or expert parallelism) that
    #: fits, else the one needing the least memory: what the chosen layout is compared against
    baseline: Candidate | None = None
    #: when no FSDP-only layout can run: the same, of the layouts without tensor or pipeline
    #: parallelism (context or expert parallel over FSDP)
    untiled: Candidate | None = None
    #: what the model refused while searching (a pinned micro-batch the batch does not divide...)
    refused: list = field(default_factory=list, repr=False)

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Pins:
    """The dimensions a caller fixes (None: searched)."""

    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    context_parallel: int | None = None
    expert_parallel: int | None = None
    data_parallel: str | None = None
    micro_batch: int | None = None
    checkpointing: str | None = None
    schedule: str | None = None
    compile: bool = False
    async_tp: bool = False
    float8: bool = False
    #: the attention kernel the run uses (``yamlformer.builder.analysis.perf.ATTENTION``)
    attention: str = "flash"
    #: the optimizer whose declared state each rank holds (``yamlformer.builder.optim``: a type name or config)
    optimizer: Any = "adamw"
    #: only what the recipes' runtime runs (``yamlformer.builder.analysis.runtime``): its combinations of tensor,
    #: context, expert and pipeline parallel x FSDP/HSDP/replicate, its schedules, full or no
    #: recomputation, tensor parallelism keeping the layers' inputs whole
    launchable: bool = False
