"""The launch planner: the fastest layout of a spec that fits a cluster, or why none does (torch-free).

:func:`plan` searches tensor x pipeline x context x expert parallel x FSDP / HSDP / replicate x
micro-batch x recomputation (none, selective, full) x pipeline schedule — every degree that
divides the cluster and the spec (``yamlformer.builder.analysis.layout.layout_problems`` refuses the rest,
each with its field) — predicts each with the performance model (``yamlformer.builder.analysis.perf``:
compute, memory-bound work, every collective over its link, the bubble, the optimizer step) on
the cluster's GPU (``yamlformer.builder.analysis.hardware``), and ranks those whose GPU holding the most
fits in the usable memory (the GPU's memory less ``headroom``, kept for the CUDA context, NCCL
buffers and allocator fragmentation).

**Ranked** (:data:`CHEAPEST`): by predicted step time (``rank_by="time"``) or GPU-hours per step
(``"cost"``: the same order on one cluster); times within 0.5% tie, and a tie goes to the
smallest tensor-parallel degree, the fewest pipeline stages, the least context and expert
parallelism, then hybrid before replicate before shard, then the largest micro-batch, then the
least memory. Any dimension can be pinned (a published run's layout, to reproduce it).

When nothing fits, :attr:`Plan.would_fit` says what would: the fewest GPUs (whole nodes), with
the same global batch, that fit; the longest sequence length that fits on these GPUs.

A fitting plan launches as a ``yamlformer.builder.analysis.launch.Launch``; the file ``builder train`` runs
turns it into its own settings (its document kind's ``launch``, ``yamlformer.builder.kinds``): this
module names no recipe field. What the recipes' runtime runs is ``yamlformer.builder.analysis.runtime``'s
table, which ``launchable`` searches within and :meth:`Candidate.launch_problems` reads.
"""

from __future__ import annotations

import dataclasses

from yamlformer.builder.analysis import runtime
from yamlformer.builder.analysis.calibration import cluster_calibration
from yamlformer.builder.analysis.hardware import Cluster
from yamlformer.builder.analysis.launchable import block_problems, blocked, context_refused, not_launchable
from yamlformer.builder.analysis.layout import (
    DATA_PARALLEL,
    Layout,
    LayoutError,
    expert_parallel_problems,
    layout_problems,
    padded_for,
)
from yamlformer.builder.analysis.perf import ATTENTION, RECOMPUTE, Calibration, Model, Prediction, Run, predict
from yamlformer.builder.analysis.plan_candidates import CHEAPEST, Candidate, Pins, Plan
from yamlformer.builder.analysis.schedules import SCHEDULES
from yamlformer.builder.optim import OptimizerError, optimizer_named

#: what callers take from here: the search, and what it returns (:mod:`.plan_candidates`)
__all__ = ["CHEAPEST", "Candidate", "Cluster", "Pins", "Plan", "divisors", "plan"]

RANK_BY = ("time", "cost")
MAX_GPUS = 65536
MIN_SEQ_LEN = 128
#: the degrees the search tries when not pinned: context parallel up to 16 with chunks of at least
#: 2,048 tokens per rank, pipeline stages up to 64
MAX_CONTEXT = 16
MIN_CONTEXT_CHUNK = 2048
MAX_STAGES = 64
#: virtual stages per rank of an interleaved schedule (as many as the runtime's)
INTERLEAVE = runtime.INTERLEAVED_STAGES
#: the planner's argument for each trainer field the runtime's rules name (``yamlformer.builder.analysis.runtime``)
RUNTIME_ARGUMENT = {
    "pipeline_schedule": "schedule",
    "activation_checkpointing": "checkpointing",
    "microbatches": "micro_batch",
    "accumulate_grad_batches": "micro_batch",
}


def plan(
    spec,
    cluster: Cluster,
    *,
    seq_len: int | None = None,
    global_batch: int,
    dtype: str = "bf16",
    src_len: int | None = None,
    rank_by: str = "time",
    calibration: Calibration | None = None,
    suggest: bool = True,
    _model: Model | None = None,
    **pinned,
) -> Plan:
    """The fastest layout of ``spec`` that fits ``cluster`` (see the module's docstring).

    ``pinned``: any :class:`Pins` field. Raises :class:`yamlformer.builder.analysis.layout.LayoutError` for
    a pinned setting no layout can take (a degree that does not divide the spec's heads, more
    stages than layers, experts that do not divide), naming the argument and the field.
    """
    pins = Pins(**pinned)
    calibration = calibration or cluster_calibration(cluster)  # its GPU's table, or the reference's fractions
    if pins.attention not in ATTENTION:
        raise LayoutError("attention", pins.attention, f"must be one of {', '.join(ATTENTION)}")
    if rank_by not in RANK_BY:
        raise LayoutError("rank_by", rank_by, f"must be one of {', '.join(RANK_BY)}")
    seq = seq_len or spec.max_seq_len
    _check_pins(spec, cluster, pins, seq)
    model = _model or Model(spec, seq, dtype, src_len)
    result = Plan(spec.name, cluster, seq, src_len, global_batch, dtype, None, calibration=calibration)
    result.params = model.estimate.params.total
    found = _search(spec, model, cluster, global_batch, dtype, pins, rank_by, calibration, result)
    if not found and result.refused:  # every layout the pins allow was refused: say why, located
        raise result.refused[0]
    found.sort(key=Candidate.key)
    fitting = [c for c in found if c.memory <= cluster.usable]
    result.considered, result.fitting = len(found), len(fitting)
    result.baseline = _best(found, cluster, lambda lay: not lay.five_d and lay.tensor_parallel == 1)
    if result.baseline is None:  # FSDP alone cannot run here: compare the best without TP or PP
        result.untiled = _best(found, cluster, lambda lay: lay.tensor_parallel == lay.pipeline_parallel == 1)
    if fitting:
        result.chosen = fitting[0]
        result.alternatives = _alternatives(fitting)
    elif suggest:
        result.would_fit = _what_would_fit(spec, model, cluster, seq, global_batch, dtype, pins, rank_by, found, result)
    return result


def _best(found: list[Candidate], cluster: Cluster, keep) -> Candidate | None:
    """The fastest of the candidates whose layout ``keep`` accepts that fits, else the one of them
    needing the least memory (None: none)."""
    kept = [c for c in found if keep(c.layout)]
    fits = [c for c in kept if c.memory <= cluster.usable]
    return min(fits, key=Candidate.key) if fits else min(kept, key=lambda c: c.memory, default=None)


def _alternatives(fitting: list[Candidate]) -> list[Candidate]:
    """The next best layout of each other shape (degrees and mode), up to four."""
    seen, out = {_shape(fitting[0])}, []
    for c in fitting[1:]:
        if _shape(c) not in seen:
            seen.add(_shape(c))
            out.append(c)
        if len(out) == 4:
            break
    return out


def _shape(c: Candidate) -> tuple:
    lay = c.layout
    return (lay.tensor_parallel, lay.pipeline_parallel, lay.context_parallel, lay.expert_parallel, lay.data_parallel)


def _check_pins(spec, cluster: Cluster, pins: Pins, seq: int) -> None:
    """A pinned setting no layout can take, as a located refusal."""
    try:
        optimizer_named(pins.optimizer)
    except OptimizerError as exc:
        raise LayoutError("optimizer", pins.optimizer, str(exc)) from None
    if pins.checkpointing is not None and pins.checkpointing not in RECOMPUTE:
        raise LayoutError("checkpointing", pins.checkpointing, f"must be one of {', '.join(RECOMPUTE)}")
    if pins.schedule is not None and pins.schedule not in SCHEDULES:
        raise LayoutError("schedule", pins.schedule, f"must be one of {', '.join(SCHEDULES)}")
    layout = Layout(
        devices=cluster.gpus,
        nodes=cluster.nodes,
        tensor_parallel=pins.tensor_parallel or 1,
        pipeline_parallel=pins.pipeline_parallel or 1,
        context_parallel=pins.context_parallel or 1,
        data_parallel=pins.data_parallel or "shard",
        expert_parallel=pins.expert_parallel or 1,
    )
    spec = padded_for(spec, layout.tensor_parallel)  # a vocabulary TP cannot split is padded, as Megatron-LM does
    problems = layout_problems(spec, layout, seq)
    if problems:
        raise problems[0]
    if pins.launchable:
        refused = runtime.launch_problems(
            layout, recompute=pins.checkpointing or "none", schedule=pins.schedule or "1f1b"
        )
        if refused:
            field, reason = refused[0]
            argument = RUNTIME_ARGUMENT.get(field, field)
            raise LayoutError(argument, getattr(pins, argument, None), f"not launchable: {reason}")
        for field, reason in block_problems(spec, layout, pins.schedule or "1f1b")[:1]:
            raise LayoutError(field, getattr(layout, field, None), f"not launchable: {reason}")


def _search(spec, model, cluster, global_batch, dtype, pins: Pins, rank_by, calibration, result) -> list[Candidate]:
    """Every layout the pins allow, each predicted, those that fit and those that do not."""
    found: list[Candidate] = []
    gpus, per_node = cluster.gpus, cluster.per_node
    n_layers = len(model.layers)
    tps = [pins.tensor_parallel] if pins.tensor_parallel else list(divisors(per_node))
    specs = {t: padded_for(spec, t) for t in tps}  # a vocabulary TP cannot split is padded, as Megatron-LM does
    tps = [
        t for t in tps if not layout_problems(specs[t], Layout(devices=gpus, nodes=cluster.nodes, tensor_parallel=t))
    ]
    models = {spec.pad_vocab_to_multiple_of: model}
    for tp in tps:
        spec_t = specs[tp]
        multiple = spec_t.pad_vocab_to_multiple_of
        if multiple not in models:
            models[multiple] = Model(spec_t, model.seq, model.dtype, model.src)
        padded = (multiple, spec_t.padded_vocab_size) if spec_t is not spec else None
        pps = [pins.pipeline_parallel] if pins.pipeline_parallel else divisors(gpus // tp)
        for pp in (p for p in pps if p <= min(n_layers, MAX_STAGES) and (gpus // tp) % p == 0):
            cps = (
                [pins.context_parallel]
                if pins.context_parallel
                else [c for c in _powers(MAX_CONTEXT) if c == 1 or result.seq_len // c >= MIN_CONTEXT_CHUNK]
            )
            for cp in (c for c in cps if (gpus // (tp * pp)) % c == 0):
                if cp > 1 and result.seq_len % (2 * cp):
                    continue  # ring attention splits the sequence in 2 x cp balanced chunks
                if pins.launchable and context_refused(spec, cp, result.reasons):
                    continue
                dp = gpus // (tp * pp * cp)
                if global_batch % dp:
                    _note(
                        result.reasons,
                        f"tensor {tp} x pipeline {pp} x context {cp}: the global batch {global_batch} does not "
                        f"divide over {dp} data-parallel ranks",
                    )
                    continue
                found += _at_degrees(
                    spec_t, models[multiple], cluster, global_batch, dtype, pins, rank_by, calibration, tp, pp, cp,
                    result, padded,
                )  # fmt: skip
    return found


def _at_degrees(
    spec, model, cluster, global_batch, dtype, pins, rank_by, calibration, tp, pp, cp, result, padded=None
) -> list[Candidate]:
    out = []
    groups = set()
    for mode in [pins.data_parallel] if pins.data_parallel else DATA_PARALLEL:
        for ep in _expert_degrees(spec, model, pins):
            try:
                layout = Layout(
                    devices=cluster.gpus,
                    nodes=cluster.nodes,
                    tensor_parallel=tp,
                    pipeline_parallel=pp,
                    context_parallel=cp,
                    data_parallel=mode,
                    expert_parallel=ep,
                )
            except LayoutError:
                continue  # hybrid on one node, experts the shard group does not divide
            if (layout.shard_size, layout.replicas, ep) in groups or layout_problems(spec, layout, model.seq):
                continue  # the same ranks as a mode tried before (a shard group of 1 is replication)
            groups.add((layout.shard_size, layout.replicas, ep))
            per_rank = global_batch // layout.data_parallel_size
            batches = [pins.micro_batch] if pins.micro_batch else divisors(per_rank)[::-1]
            schedules = [pins.schedule] if pins.schedule else (["1f1b", "interleaved-1f1b", "zero-bubble"])
            if pp == 1:
                schedules = schedules[:1]
            if pins.launchable:  # what the runtime runs of this layout, the rest noted once each
                schedules = [s for s in schedules if not not_launchable(layout, "none", s, result.reasons)]
                schedules = [s for s in schedules if not blocked(spec, layout, s, result.reasons)]
            recomputes = [pins.checkpointing] if pins.checkpointing else list(RECOMPUTE)
            if pins.launchable:
                recomputes = [r for r in recomputes if r != "selective"]
            for recompute in recomputes:
                for schedule in schedules:
                    best = _best_micro_batch(
                        spec,
                        model,
                        cluster,
                        layout,
                        global_batch,
                        dtype,
                        pins,
                        recompute,
                        schedule,
                        batches,
                        calibration,
                        result.refused,
                    )
                    refused = block_problems(spec, layout, schedule)
                    out += [Candidate(p, rank_by, refused, padded) for p in best]
    return out


def _chunks_per_rank(schedule: str, launchable: bool) -> int:
    """Stages a pipeline rank holds: interleaved 1F1B's virtual stages; the runtime's zero-bubble
    schedule (zbv) places two per rank in a V, where the performance model sizes ZB-H1's one per
    rank (its time and memory; ``describe`` of the launched recipe counts the V's states exactly)."""
    return runtime.stage_placement(runtime.SCHEDULE_NAMES[schedule] if launchable else schedule)[0]


def _best_micro_batch(
    spec, model, cluster, layout, global_batch, dtype, pins, recompute, schedule, batches, cal, refused
):
    """The fastest micro-batch that fits, and the smallest one tried (so a layout that never
    fits is still counted); largest first, stopping once the time stops falling. What the model
    refuses (a micro-batch count the schedule cannot take) goes to ``refused``."""
    kept: list[Prediction] = []
    best = None
    smallest = None
    for mb in batches:
        chunks = _chunks_per_rank(schedule, pins.launchable)
        if chunks > 1 and layout.pipeline_parallel * chunks > len(model.layers):
            refused.append(
                LayoutError(
                    "pipeline_parallel",
                    layout.pipeline_parallel,
                    f"x {chunks} {schedule} stages per rank is more chunks than the {len(model.layers)} layers",
                )
            )
            continue
        run = Run(
            seq_len=model.seq,
            global_batch=global_batch,
            micro_batch=mb,
            recompute=recompute,
            schedule=schedule,
            stages_per_rank=INTERLEAVE if schedule == "interleaved-1f1b" else 1,
            compile=pins.compile,
            async_tp=pins.async_tp,
            float8=pins.float8,
            attention=pins.attention,
            dtype=dtype,
            sequence_parallel=not pins.launchable,  # the recipes' TP keeps inputs and logits whole
            context_gather=pins.launchable,  # the recipes' CP all-gathers keys and values
            optimizer=pins.optimizer,
        )
        try:
            p = predict(spec, layout, run, cluster.hardware, cal, model=model)
        except LayoutError as exc:
            refused.append(exc)
            continue
        if pins.launchable and Candidate(p).launch_problems():
            continue  # a micro-batch count the runtime's schedule cannot take
        smallest = p
        if p.memory_per_gpu_bytes <= cluster.usable:
            if best is not None and p.step_s >= best.step_s:
                break
            best = p
    if best is not None:
        kept.append(best)
    elif smallest is not None:
        kept.append(smallest)
    return kept


def _expert_degrees(spec, model: Model, pins: Pins) -> list[int]:
    """The expert-parallel degrees to try: powers of two dividing the experts; with ``launchable``
    only those every expert block splits as the recipes run it (``expert_parallel_problems``)."""
    if pins.expert_parallel:
        return [pins.expert_parallel]
    if model.experts is None:
        return [1]
    degrees = [e for e in divisors(model.experts[0]) if e in _powers(model.experts[0])]
    return [e for e in degrees if not (pins.launchable and expert_parallel_problems(spec, e))]


def _powers(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def divisors(n: int) -> list[int]:
    """Every divisor of ``n`` in ascending order, in O(sqrt(n)) steps (a global batch may be 2**30)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _note(reasons: list[str], reason: str) -> None:
    if reason not in reasons:
        reasons.append(reason)


def _what_would_fit(spec, model, cluster, seq, global_batch, dtype, pins, rank_by, found, result) -> list[str]:
    """Why nothing fits, and what would: the fewest GPUs (whole nodes, doubling), the longest
    sequence (halving)."""
    again = {
        "dtype": dtype,
        "rank_by": rank_by,
        "suggest": False,
        "calibration": result.calibration,
        **dataclasses.asdict(pins),
    }
    out = []
    if found:
        least = min(found, key=lambda c: c.memory)
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in least.prediction.memory.items())
        result.reasons.append(
            f"the layout needing the least memory, {least.summary()}, needs {_gib(least.memory)} per GPU ({parts}), "
            f"more than the {_gib(cluster.usable)} usable"
        )
    elif not result.reasons:
        result.reasons.append("no layout the pins allow divides these GPUs")
    gpus = cluster.gpus
    while gpus < MAX_GPUS:
        gpus *= 2
        bigger = plan(
            spec,
            cluster.with_gpus(gpus),
            seq_len=seq,
            src_len=result.src_len,
            global_batch=global_batch,
            _model=model,
            **again,
        )
        if bigger.chosen is not None:
            out.append(
                f"{gpus} GPUs ({gpus // cluster.per_node} nodes x {cluster.per_node}): {bigger.chosen.summary()}"
            )
            break
    else:
        out.append(f"no GPU count up to {MAX_GPUS} fits a global batch of {global_batch}")
    shorter = seq
    while shorter // 2 >= MIN_SEQ_LEN:
        shorter //= 2
        src = min(result.src_len, shorter) if result.src_len else None
        short = plan(spec, cluster, seq_len=shorter, src_len=src, global_batch=global_batch, **again)
        if short.chosen is not None:
            out.append(f"seq_len {shorter} on these {cluster.gpus} GPUs: {short.chosen.summary()}")
            break
    else:
        out.append(f"no sequence length down to {MIN_SEQ_LEN} fits on {cluster.gpus} GPUs")
    return out


def _gib(n: float) -> str:
    # local: the report's tables (rich) load only when a plan is printed
    from yamlformer.builder.analysis.report import human_bytes

    return human_bytes(n)
