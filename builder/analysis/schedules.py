"""The pipeline schedules the performance model (``yamlformer.builder.analysis.perf``) knows, and what each
costs: the idle time (the bubble) and the micro-batches' activations in flight (torch-free)."""

from __future__ import annotations

SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "zero-bubble")


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The pipeline's idle time over ``microbatches`` micro-batches' work (0 without pipelining)."""
    if stages == 1:
        return 0.0
    idle = {"gpipe": 1.0, "1f1b": 1.0, "interleaved-1f1b": 1.0 / virtual, "zero-bubble": 1.0 / 3}[schedule]
    return idle * (stages - 1) / microbatches


def in_flight(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Micro-batches' activations (of the whole stage) the first stage keeps at once: GPipe all of
    them, 1F1B and ZB-H1 ``p``, interleaved 1F1B ``(2(p-1) + (v-1)p + 1)`` chunks of ``1/v``
    (Narayanan et al. 2021's warm-up)."""
    if stages == 1 or schedule == "gpipe":
        return microbatches if stages > 1 else 1
    if schedule == "interleaved-1f1b":
        return min(microbatches * virtual, 2 * (stages - 1) + (virtual - 1) * stages + 1) / virtual
    return min(stages, microbatches)
