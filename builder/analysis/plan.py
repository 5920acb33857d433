"""The launch planner: the cheapest layout of a spec that fits a cluster, or why none does (torch-free).

:func:`plan` tries every layout a recipe can launch on ``gpus`` GPUs — each tensor-parallel degree
that divides a node and the spec (``builder.analysis.layout``), FSDP full sharding, HSDP (on several
nodes) or replication, activation checkpointing off and on, and every micro-batch that divides the
global batch — and sizes each with the same per-rank accounting ``builder describe --strategy
fsdp`` prints. A layout fits when the rank holding the most needs no more than the usable memory
(the GPU's memory less ``headroom``, kept for the CUDA context, NCCL buffers and allocator
fragmentation).

**Cheapest** (:data:`CHEAPEST`): the fewest GPU-hours per optimizer step at the stated MFU, the
step's FLOPs being the estimate's training FLOPs (3x forward, 4x with activation checkpointing,
which runs the forward again); among equals, the least communication: the smallest
tensor-parallel degree, then hybrid before replicate before shard (the fewest bytes between
nodes), then the largest micro-batch (the fewest accumulation steps), then the least memory.

When nothing fits, :attr:`Plan.would_fit` says what would: the fewest GPUs (whole nodes), with
the same global batch, that fit; the longest sequence length that fits on these GPUs.

A fitting plan launches as a :class:`Launch`; the file ``builder train`` runs turns it into its
own settings (its document kind's ``launch``, ``builder.spec.kinds``): this module names no
recipe field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from builder.analysis.estimates import Step, estimate
from builder.analysis.layout import (
    DATA_PARALLEL,
    Layout,
    LayoutError,
    check_tensor_parallel,
    model_tensors,
    rank_states,
    tensor_parallel_problems,
    tensor_parallel_spec,
    unit_sizes,
)
from builder.analysis.memory import BYTES

CHEAPEST = (
    "cheapest = fewest GPU-hours per optimizer step at the stated MFU (training FLOPs: 3x forward, "
    "4x with activation checkpointing); ties go to the smallest tensor-parallel degree, then "
    "hybrid, replicate, shard (fewest bytes between nodes), then the largest micro-batch, then the "
    "least memory per GPU"
)
#: tie order of the data-parallel modes (fewest bytes between nodes first)
DP_ORDER = {"hybrid": 0, "replicate": 1, "shard": 2}
MAX_GPUS = 65536
MIN_SEQ_LEN = 128


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs of ``memory`` bytes, ``per_node`` to a node, ``peak`` dense FLOP/s each."""

    gpus: int
    per_node: int
    memory: int
    peak: float
    gpu: str = "H100 SXM"
    headroom: float = 0.10

    @property
    def nodes(self) -> int:
        return self.gpus // self.per_node

    @property
    def usable(self) -> int:
        return int(self.memory * (1 - self.headroom))

    def with_gpus(self, gpus: int) -> Cluster:
        return dataclasses.replace(self, gpus=gpus)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    micro_batch: int
    accumulation: int
    checkpointing: bool
    memory: int  # training bytes of the rank holding the most
    step_flops: int
    step_seconds: float

    @property
    def gpu_hours(self) -> float:
        return self.layout.devices * self.step_seconds / 3600

    def key(self) -> tuple:
        return (
            self.gpu_hours,
            self.layout.tensor_parallel,
            DP_ORDER[self.layout.data_parallel],
            -self.micro_batch,
            self.memory,
        )

    def summary(self) -> str:
        ckpt = "activation checkpointing" if self.checkpointing else "no activation checkpointing"
        return (
            f"{self.layout.describe()}; micro-batch {self.micro_batch} x {self.accumulation} "
            f"accumulation step{'s' if self.accumulation > 1 else ''}; {ckpt}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_dict(),
            "micro_batch": self.micro_batch,
            "accumulate_grad_batches": self.accumulation,
            "activation_checkpointing": self.checkpointing,
            "memory": self.memory,
            "step_flops": self.step_flops,
            "step_seconds": self.step_seconds,
            "gpu_hours_per_step": self.gpu_hours,
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
    mfu: float
    chosen: Candidate | None
    estimate: Any = None  # builder.analysis.estimates.Estimate of the chosen layout, as describe prints it
    alternatives: list[Candidate] = field(default_factory=list)
    considered: int = 0
    reasons: list[str] = field(default_factory=list)  # why layouts were left out or nothing fits
    would_fit: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def plan(
    spec,
    cluster: Cluster,
    *,
    seq_len: int | None = None,
    global_batch: int,
    dtype: str = "bf16",
    mfu: float = 0.4,
    src_len: int | None = None,
    tensor_parallel: int | None = None,
    data_parallel: str | None = None,
    suggest: bool = True,
    _states: _States | None = None,
) -> Plan:
    """The cheapest layout of ``spec`` that fits ``cluster`` (see the module's docstring).

    ``tensor_parallel`` / ``data_parallel`` pin the search to one degree or mode. Raises
    :class:`builder.analysis.layout.LayoutError` for settings no layout can satisfy (a pinned degree that
    does not divide the spec's heads, say).
    """
    seq = seq_len or spec.max_seq_len
    if tensor_parallel is not None or data_parallel is not None:  # a pinned setting no layout can take
        Layout(
            devices=cluster.gpus,
            nodes=cluster.nodes,
            tensor_parallel=tensor_parallel or 1,
            data_parallel=data_parallel or "shard",
        )
        check_tensor_parallel(spec, tensor_parallel or 1)
    sizer = _Sizer(_states or _States(spec), seq, src_len, dtype)
    result = Plan(spec.name, cluster, seq, src_len, global_batch, dtype, mfu, None)
    candidates = _search(sizer, cluster, global_batch, mfu, tensor_parallel, data_parallel, result.reasons)
    result.reasons[:0] = _refused_degrees(sizer, cluster, tensor_parallel)
    result.considered = len(candidates)
    candidates.sort(key=Candidate.key)
    for candidate in candidates:
        step = Step(
            seq_len=seq,
            src_len=src_len,
            batch=candidate.micro_batch,
            dtype=dtype,
            activation_checkpointing=candidate.checkpointing,
        )
        est = estimate(spec, step, candidate.layout)
        if est.memory.training_total <= cluster.usable:  # as describe counts it, not the search's sum
            result.chosen = dataclasses.replace(candidate, memory=est.memory.training_total)
            result.estimate = est
            break
    if result.chosen is not None:
        result.alternatives = [c for c in candidates if c is not result.chosen and c.key() > result.chosen.key()][:4]
    elif suggest:
        result.would_fit = _what_would_fit(
            spec, sizer, cluster, seq, src_len, global_batch, dtype, mfu, tensor_parallel, data_parallel, result.reasons
        )
    return result


class _States:
    """What does not depend on the sequence: the tensors, and cached per tensor-parallel degree
    its problems and largest unit, per (degree, shard group) rank 0's states."""

    def __init__(self, spec):
        self.spec = spec
        self.tensors = model_tensors(spec)
        self.held: dict[tuple[int, int], int] = {}
        self.units: dict[int, int] = {}
        self.problems: dict[int, list] = {}


class _Sizer:
    """The parts of a layout's memory at one sequence length, cached: per (tensor-parallel
    degree, checkpointing) the activation bytes, affine in the micro-batch (the chosen layout is
    re-estimated in full)."""

    def __init__(self, states: _States, seq: int, src_len: int | None, dtype: str):
        self.states, self.spec, self.seq, self.src_len, self.dtype = states, states.spec, seq, src_len, dtype
        self.forward = estimate(self.spec, Step(seq_len=seq, src_len=src_len, dtype=dtype)).flops.forward_per_sequence
        self._activations: dict[tuple[int, bool], tuple[int, int]] = {}

    def tp_problems(self, tp: int) -> list:
        problems = self.states.problems
        if tp not in problems:
            problems[tp] = tensor_parallel_problems(self.spec, tp)
        return problems[tp]

    def activations(self, tp: int, checkpointing: bool, batch: int) -> int:
        key = (tp, checkpointing)
        if key not in self._activations:
            local = tensor_parallel_spec(self.spec, tp)
            one, two = (
                estimate(
                    local,
                    Step(
                        seq_len=self.seq,
                        src_len=self.src_len,
                        batch=b,
                        dtype=self.dtype,
                        activation_checkpointing=checkpointing,
                    ),
                ).memory.activations
                for b in (1, 2)
            )
            self._activations[key] = (one, two - one)
        base, per_sequence = self._activations[key]
        return base + (batch - 1) * per_sequence

    def fixed(self, layout: Layout) -> int:
        """Rank 0's parameters, gradients, AdamW states and the units in flight."""
        held, _, in_flight = self.fixed_parts(layout)
        return held + in_flight

    def fixed_parts(self, layout: Layout) -> tuple[int, tuple[str, int], int]:
        """:meth:`fixed` in its parts: rank 0's sharded states, the largest FSDP unit (its name and
        elements, gathered whole by one tensor-parallel rank) and the bytes it takes in flight (two
        gathered copies and its unsharded gradients in the compute dtype, their fp32 reduce input)."""
        tp, cache = layout.tensor_parallel, self.states
        key = (tp, layout.shard_size)
        if key not in cache.held:
            states = rank_states(self.spec, layout, 0, cache.tensors)
            cache.held[key] = states.weights + states.gradients + states.optimizer
        if tp not in cache.units:
            cache.units[tp] = max(unit_sizes(cache.tensors, tp).items(), key=lambda item: item[1], default=("", 0))
        unit = cache.units[tp]
        return cache.held[key], unit, unit[1] * (3 * BYTES[self.dtype] + 4)

    def step_flops(self, global_batch: int, checkpointing: bool) -> int:
        return self.forward * global_batch * (4 if checkpointing else 3)


def _search(
    sizer: _Sizer,
    cluster: Cluster,
    global_batch: int,
    mfu: float,
    pin_tp: int | None,
    pin_dp: str | None,
    reasons: list[str],
) -> list[Candidate]:
    """Every fitting layout, each with the largest micro-batch that fits."""
    found = []
    degrees = [pin_tp] if pin_tp else divisors(cluster.per_node)
    for tp in degrees:
        if sizer.tp_problems(tp):
            continue
        dp = cluster.gpus // tp
        if global_batch % dp:
            _note(
                reasons,
                f"tensor-parallel {tp}: the global batch {global_batch} does not divide over {dp} data-parallel ranks",
            )
            continue
        per_rank = global_batch // dp
        batches = divisors(per_rank)[::-1]
        groups = set()
        for mode in [pin_dp] if pin_dp else DATA_PARALLEL:
            try:
                layout = Layout(devices=cluster.gpus, nodes=cluster.nodes, tensor_parallel=tp, data_parallel=mode)
            except LayoutError:
                continue  # hybrid on one node
            if layout.shard_size in groups:
                continue  # the same ranks as a mode tried before (a shard group of 1 is replication)
            groups.add(layout.shard_size)
            fixed = sizer.fixed(layout)
            for checkpointing in (False, True):
                batch = next(
                    (b for b in batches if fixed + sizer.activations(tp, checkpointing, b) <= cluster.usable), None
                )
                if batch is None:
                    continue
                flops = sizer.step_flops(global_batch, checkpointing)
                found.append(
                    Candidate(
                        layout=layout,
                        micro_batch=batch,
                        accumulation=per_rank // batch,
                        checkpointing=checkpointing,
                        memory=fixed + sizer.activations(tp, checkpointing, batch),
                        step_flops=flops,
                        step_seconds=flops / (cluster.gpus * cluster.peak * mfu),
                    )
                )
    return found


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


def _refused_degrees(sizer: _Sizer, cluster: Cluster, pin_tp: int | None) -> list[str]:
    """One line per spec field that rules out tensor-parallel degrees a node could hold."""
    degrees = [pin_tp] if pin_tp else divisors(cluster.per_node)[1:]
    fields: dict[str, list[int]] = {}
    for tp in degrees:
        for loc, _ in sizer.tp_problems(tp):
            fields.setdefault(".".join(map(str, loc)), []).append(tp)
    return [
        f"tensor-parallel {', '.join(map(str, tps))} ruled out: {path} ({_field(sizer.spec, path)}) does not "
        f"divide by {'it' if len(tps) == 1 else 'them'}"
        for path, tps in fields.items()
    ]


def _field(spec, path: str):
    value = spec
    for part in path.split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part, None)
    return value


def _note(reasons: list[str], reason: str) -> None:
    if reason not in reasons:
        reasons.append(reason)


def _what_would_fit(spec, sizer, cluster, seq, src_len, global_batch, dtype, mfu, pin_tp, pin_dp, reasons) -> list[str]:
    """Why nothing fits, and what would: a global batch the data-parallel ranks divide, the fewest
    GPUs (whole nodes, doubling), the longest sequence (halving)."""
    again = {
        "dtype": dtype,
        "mfu": mfu,
        "tensor_parallel": pin_tp,
        "data_parallel": pin_dp,
        "suggest": False,
        "_states": sizer.states,
    }
    degrees = [
        t
        for t in ([pin_tp] if pin_tp else divisors(cluster.per_node))
        if cluster.per_node % t == 0 and not sizer.tp_problems(t)
    ]
    dividing = [t for t in degrees if global_batch % (cluster.gpus // t) == 0]
    out = []
    if not dividing:
        batch = min((global_batch + (-global_batch) % (cluster.gpus // t) for t in degrees), default=None)
        other = batch and plan(spec, cluster, seq_len=seq, global_batch=batch, src_len=src_len, **again)
        if other and other.chosen is not None:
            out.append(f"global batch {batch} on these {cluster.gpus} GPUs: {other.chosen.summary()}")
        return out
    layouts = [Layout(devices=cluster.gpus, nodes=cluster.nodes, tensor_parallel=t) for t in dividing]
    best = min(layouts, key=sizer.fixed)
    floor = sizer.fixed(best)
    if floor > cluster.usable:
        held, (unit, elements), in_flight = sizer.fixed_parts(best)
        shrink = (
            "a smaller unit (more tensor parallelism, or experts split over ranks) is what would shrink it"
            if in_flight > held
            else "more GPUs shrink the shard"
        )
        reasons.append(
            f"the weights, gradients and AdamW states alone need {_gib(floor)} per GPU over all {cluster.gpus} GPUs "
            f"(tensor-parallel {best.tensor_parallel}), more than the {_gib(cluster.usable)} usable: {_gib(held)} is "
            f"this rank's shard of them (16 bytes per parameter, sharded), and {_gib(in_flight)} is the largest "
            f"FSDP unit, {unit or 'the model'} ({elements:,} parameters per tensor-parallel rank), which FSDP gathers "
            f"whole to compute it (two copies and its gradients in flight) however many GPUs shard it; {shrink}"
        )
    else:
        reasons.append(
            f"the sharded states fit ({_gib(floor)} per GPU) but no micro-batch of one sequence "
            f"of {seq} tokens leaves room for its activations, even with checkpointing"
        )
    gpus = cluster.gpus
    while gpus < MAX_GPUS:
        gpus *= 2
        if _search(sizer, cluster.with_gpus(gpus), global_batch, mfu, pin_tp, pin_dp, []):
            bigger = plan(
                spec, cluster.with_gpus(gpus), seq_len=seq, global_batch=global_batch, src_len=src_len, **again
            )
            if bigger.chosen is not None:
                out.append(
                    f"{gpus} GPUs ({gpus // cluster.per_node} nodes x {cluster.per_node}): {bigger.chosen.summary()}"
                )
                break
    else:
        out.append(f"no GPU count up to {MAX_GPUS} fits a global batch of {global_batch}")
    if floor > cluster.usable:
        out.append(f"no shorter sequence: the states alone exceed the memory of {cluster.gpus} GPUs")
        return out
    shorter = seq
    while shorter // 2 >= MIN_SEQ_LEN:
        shorter //= 2
        short = plan(
            spec,
            cluster,
            seq_len=shorter,
            global_batch=global_batch,
            src_len=min(src_len, shorter) if src_len else None,
            **again,
        )
        if short.chosen is not None:
            out.append(f"seq_len {shorter} on these {cluster.gpus} GPUs: {short.chosen.summary()}")
            break
    else:
        out.append(f"no sequence length down to {MIN_SEQ_LEN} fits on {cluster.gpus} GPUs")
    return out


def _gib(n: float) -> str:
    from builder.analysis.report import human_bytes

    return human_bytes(n)


# -- launch lines ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """What a launch of a plan's chosen layout fixes, for the file ``builder train`` runs to set
    (its document kind's ``launch``, ``builder.spec.kinds``): micro-batches of ``seq_len`` tokens
    on ``candidate``'s layout, with its accumulation and checkpointing, in ``dtype``. ``spec`` (a
    file or a zoo name) and ``spec_overrides`` (``KEY=VALUE``) replace the model the file trains,
    ``max_steps`` and ``output_dir`` its own (the plan's budget is steps); ``None``: the file's."""

    candidate: Candidate
    seq_len: int
    dtype: str
    spec: str | None = None
    spec_overrides: tuple[str, ...] = ()
    max_steps: int | None = None
    output_dir: str | None = None

    @property
    def layout(self) -> Layout:
        return self.candidate.layout


def launch_lines(recipe: str, sets: list[str], layout: Layout) -> dict[str, str]:
    """``torchrun`` (run on every node) and SLURM (``sbatch``) lines for ``builder train``."""
    import shlex

    flags = " ".join(f"--set {shlex.quote(item)}" for item in sets)
    train = f"train {shlex.quote(recipe)} {flags}"
    if layout.nodes > 1:
        where = (
            f"--nnodes={layout.nodes} --nproc-per-node={layout.per_node} --node-rank=$NODE_RANK "
            "--rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29500"
        )
    else:
        where = f"--standalone --nproc-per-node={layout.per_node}"
    slurm = (
        f"sbatch --nodes={layout.nodes} --ntasks-per-node={layout.per_node} "
        f"--gpus-per-node={layout.per_node} --wrap={shlex.quote(f'srun builder {train}')}"
    )
    return {"torchrun": f"torchrun {where} -m builder.cli {train}", "slurm": slurm}
