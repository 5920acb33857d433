"""Per-GPU memory of a layout with pipeline, context or expert parallelism (torch-free), as
``builder describe --pipeline-parallel ...`` prints it and ``builder train --dry-run`` prints it
for a recipe's trainer layout: the performance model's count (:func:`yamlformer.builder.analysis.perf.memory`)
of the stage holding the most, each pipeline stage's parameters, gradients and optimizer state
exact (:func:`yamlformer.builder.analysis.shards.pipeline_rank_states`, the stages placed as the runtime's
schedule places them)."""

from __future__ import annotations

from yamlformer.builder.analysis import runtime
from yamlformer.builder.analysis.layout import Layout

#: a schedule as the runtime names it (``trainer.pipeline_schedule``) -> the performance model's
#: name; the V-shaped ones are sized as zero-bubble (ZB-H1's bubble and 1F1B's micro-batches in flight)
PERF_SCHEDULES = {name: perf for perf, name in runtime.SCHEDULE_NAMES.items()} | {"dualpipev": "zero-bubble"}


def layout_memory(
    spec,
    layout: Layout,
    *,
    seq_len: int,
    micro_batch: int,
    dtype: str,
    checkpointing: bool,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    optimizer="adamw",
) -> dict | None:
    """``{"layout", "parts", "per_gpu_bytes"}`` of ``layout`` running micro-batches of
    ``micro_batch`` sequences of ``seq_len`` tokens (the whole sequence: context parallelism splits
    it), ``microbatches`` of them per pipelined step (default one per stage, as torchtitan); None
    for a layout without pipeline, context or expert parallelism (``estimate`` counts that one
    exactly). Tensor parallelism is sized sequence-parallel; context parallelism as the recipes
    run it, every layer keeping the keys and values it gathered. ``optimizer``: whose declared state
    is counted (``yamlformer.builder.optim``)."""
    # local: the performance model (and the exact per-stage count) loads only for a layout with
    # pipeline, context or expert parallelism
    from yamlformer.builder.analysis.perf import Model, Run, memory
    from yamlformer.builder.analysis.shards import pipeline_rank_states

    if max(layout.pipeline_parallel, layout.context_parallel, layout.expert_parallel) == 1:
        return None
    per_rank, style = runtime.stage_placement(schedule)
    perf_schedule = PERF_SCHEDULES.get(schedule, schedule)
    virtual = per_rank if perf_schedule == "interleaved-1f1b" else 1
    micro = microbatches or layout.pipeline_parallel * per_rank
    run = Run(
        seq_len=seq_len,
        global_batch=micro_batch * micro * layout.data_parallel_size,
        micro_batch=micro_batch,
        recompute="full" if checkpointing else "none",
        schedule=perf_schedule,
        stages_per_rank=virtual,
        dtype=dtype,
        context_gather=True,
        optimizer=optimizer,
    )
    exact = None
    if layout.pipeline_parallel > 1:
        exact = [
            r.weights + r.gradients + r.optimizer
            for r in pipeline_rank_states(spec, layout, per_rank, style, optimizer)
        ]
    parts = memory(Model(spec, seq_len, dtype), layout, run, exact)
    return {"layout": layout.to_dict(), "parts": parts, "per_gpu_bytes": sum(parts.values())}
