"""The performance model: one training step's time and memory per GPU on a 5-D layout (torch-free).

:func:`predict` takes a spec, a :class:`yamlformer.builder.analysis.layout.Layout` (tensor, pipeline,
context, expert parallel, FSDP / HSDP / replicate), a :class:`Run` (sequence, global batch,
micro-batch, recomputation, pipeline schedule, compile, async TP, float8, attention backend) and a
:class:`yamlformer.builder.analysis.hardware.GPU` with its calibration
(``yamlformer.builder.analysis.calibration``: the GPU's measured kernel rates), and returns a
:class:`Prediction`: the step time in parts, tokens/s per GPU, MFU and the memory of the GPU
holding the most. Every term is a count (FLOPs, bytes, collectives) over a measured rate; nothing
is fitted to a published run (``benchmarks/plan_vs_published.py`` checks them):

* **GEMMs** (``gemm``): each linear of each layer (its blocks' ``param_shapes``, one
  tensor-parallel rank's; the head's vocabulary projection), forward, input gradient and weight
  gradient, at the rate the calibration measured for its shape and dtype (float8 under
  ``Run.float8`` for every dense linear torchao converts; the head stays in the compute dtype),
  the bandwidth bound below the measured shapes; recomputation runs the forward GEMMs again
  (``full``) or :data:`SELECTIVE_RECOMPUTE` of them (``selective``, torchtitan's per-op policy).
* **Attention** (``attention``): the kernels' FLOPs over the pairs they visit (the spec's
  estimate), at the rate of the run's backend (``Run.attention``: SDPA's ``flash`` or ``cudnn``,
  this project's ``triton``) at their lengths (``yamlformer.builder.analysis.perf_terms.attention_seconds``).
* **Memory-bound work** (``memory_bound``, ``optimizer``): the HBM bytes the blocks count for
  their norms, activations, rotations, residual adds, copies and the loss
  (``yamlformer.blocks.configs.traffic``: eager, or fused under ``Run.compile``; recomputation runs
  the forward's again, torchtitan's per-op policy recomputing every elementwise op too), the
  embedding's lookup and gradient, torchao's float8 casts, FSDP2's copies around its collectives
  and the optimizer step with gradient clipping (the state :attr:`Run.optimizer` declares read and
  written, ``yamlformer.builder.analysis.calibration.optimizer_bytes_per_parameter``; Muon's
  Newton-Schulz GEMMs are not counted), over the measured HBM
  bandwidth. :attr:`Prediction.memory_bound` gives the bytes' seconds by part.
* **Communication**, each collective's bytes over the link it crosses (NVLink when its group
  fits in a node, else the network), ring or tree by group size (``collective_seconds``), at
  ``collective_efficiency`` of the link. Overlapped: FSDP's all-gathers and reduce-scatters (and
  HSDP's all-reduce) with the layers' compute, prefetched one unit ahead, so only the first
  gather, the last reduce and what exceeds the compute are exposed (under pipelining FSDP
  gathers and reduces once a step, behind one micro-batch's compute); ring attention's key/value
  passes and their gradients' with the ring steps' attention kernels, as torch's ring runs them
  (:func:`context_parallel_seconds`: under its default ``allgather`` rotation the whole gather
  behind the first step alone); EP dispatch/combine with the rest of the layer's compute.
  Exposed: tensor parallelism's all-gathers and reduce-scatters (sequence parallel), unless
  ``async_tp`` (then only what exceeds the matmul each overlaps), and the pipeline's sends.
* **Pipeline bubble** (:func:`yamlformer.builder.analysis.schedules.bubble_fraction`): GPipe and 1F1B
  ``(p-1)/m``, interleaved 1F1B ``(p-1)/(v m)``, zero-bubble (ZB-H1, Qi et al. 2023)
  ``(p-1)/(3m)`` of ``m`` micro-batches' time.
* **Memory** (:func:`memory`): per local parameter element sharded over the FSDP group, fp32
  master weights and gradients and the optimizer's declared state (:attr:`Run.optimizer`; AdamW's
  two states: 16 bytes in all), the stage holding the most (the
  layers split evenly, the embedding on the first, the head on the last), two gathered units and
  one unit's gradients in flight (under pipeline parallelism FSDP keeps the stage's parameters
  and gradients unsharded, as torchtitan does, ``reshard_after_forward=False``), and the
  activations the schedule keeps in flight (1F1B: ``p`` micro-batches on the first stage), and
  backward's transient (the gradients of the largest block it differentiates at once); a compiled
  loss (``Run(compile_loss=True)``) keeps no fp32 log-probabilities. Under
  tensor parallelism the activations are sequence-parallel (one ``tp``-th per rank, as
  torchtitan runs) or, ``Run(sequence_parallel=False)``, what ``describe``'s tensor-parallel view
  keeps (inputs, norms and logits whole, as this project's recipes run). Under context
  parallelism each rank keeps ``1/cp`` of every activation, and, ``Run(context_gather=True)`` (the
  recipes' all-gather attention), every layer's gathered keys and values of the whole sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from yamlformer.builder.analysis.calibration import (
    CLIP_BYTES,
    SELECTIVE_RECOMPUTE,
    SELECTIVE_SAVED,
    Calibration,
    collective_seconds,
    optimizer_bytes_per_parameter,
    reference,
)
from yamlformer.builder.analysis.hardware import GPU
from yamlformer.builder.analysis.layout import Layout, LayoutError, check_layout
from yamlformer.builder.analysis.memory import BYTES
from yamlformer.builder.analysis.perf_model import Model
from yamlformer.builder.analysis.perf_terms import (
    attention_seconds,
    float8_cast_bytes,
    fsdp_copy_bytes,
    gemm_seconds,
    linear_flops,
    tensor_parallel_seconds,
)
from yamlformer.builder.analysis.schedules import SCHEDULES, bubble_fraction, in_flight

__all__ = ["Model", "Prediction", "Run", "Calibration", "collective_seconds", "context_parallel_seconds", "predict"]

RECOMPUTE = ("none", "selective", "full")
CP_ROTATE = ("allgather", "alltoall")
#: attention kernels a run may use: SDPA's flash and cuDNN backends, this project's Triton kernel
ATTENTION = ("flash", "cudnn", "triton")


@dataclass(frozen=True)
class Run:
    """What one optimizer step computes and how: ``global_batch`` sequences of ``seq_len`` tokens,
    ``micro_batch`` sequences per micro-batch of one data-parallel rank, recomputation ``none``,
    ``selective`` or ``full``, a pipeline ``schedule`` with ``stages_per_rank`` virtual stages
    (interleaved), ``compile``, ``async_tp``, ``float8`` projections (and ``float8_all_gather``:
    FSDP gathers their weights in float8); ``sequence_parallel``: under tensor parallelism the
    layers' inputs, norms and the loss split over the TP ranks as torchtitan splits them (False:
    whole on every rank, the logits gathered, as this project's recipes run TP); ``context_gather``:
    context parallelism all-gathers the keys and values (as this project's recipes run it) rather
    than passing them round a ring; ``attention``: the attention kernel (:data:`ATTENTION`)."""

    seq_len: int
    global_batch: int
    micro_batch: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    compile: bool = False
    async_tp: bool = False
    float8: bool = False
    dtype: str = "bf16"
    float8_all_gather: bool = False  # FSDP gathers float8 weights (1 byte each), with float8
    sequence_parallel: bool = True  # TP splits the layers' inputs and the loss too (torchtitan); False: whole
    #: CP gathers every rank's keys and values before attention and keeps them for backward (the
    #: recipes' all-gather context parallelism, Llama 3's); False: ring attention passes them on (torchtitan)
    context_gather: bool = False
    #: how torch's ring attention passes the keys and values: ``allgather`` (torch's and torchtitan's
    #: default: one all-gather a pass, behind only the first ring step's kernel) or ``alltoall`` (one
    #: shard a step, each behind a step's kernel); their gradients go round a step at a time in fp32
    cp_rotate: str = "allgather"
    #: the loss compiled with the model (torchtitan's since 2025, this project's ``compile: model``):
    #: no fp32 log-probabilities kept (``yamlformer.blocks.configs.base.loss_saved_bytes``)
    compile_loss: bool = False
    #: keys and values repeated to every query head before attention (torchtitan's Llama of 2024, SDPA
    #: without grouped-query support), so context parallelism moves n_heads / n_kv_heads times the bytes
    kv_repeat: bool = False
    attention: str = "flash"
    #: the optimizer whose declared state is counted (``yamlformer.builder.optim``: a type name or a config)
    optimizer: Any = "adamw"

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise LayoutError("checkpointing", self.recompute, f"must be one of {', '.join(RECOMPUTE)}")
        if self.schedule not in SCHEDULES:
            raise LayoutError("schedule", self.schedule, f"must be one of {', '.join(SCHEDULES)}")
        if self.dtype not in BYTES:
            raise LayoutError("dtype", self.dtype, f"must be one of {', '.join(BYTES)}")
        if self.cp_rotate not in CP_ROTATE:
            raise LayoutError("cp_rotate", self.cp_rotate, f"must be one of {', '.join(CP_ROTATE)}")
        if self.attention not in ATTENTION:
            raise LayoutError("attention", self.attention, f"must be one of {', '.join(ATTENTION)}")
        for name in ("seq_len", "global_batch", "micro_batch", "stages_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(name, value, "must be a positive integer")


def context_parallel_seconds(kv: float, core: float, cp: int, bandwidth: float, run: Run, cal: Calibration):
    """``(all, exposed)`` seconds of one layer's context-parallel traffic for one micro-batch:
    ``kv`` bytes of keys and values per rank, ``core`` seconds of its attention kernels forward
    (a ring step runs ``1/cp`` of it, backward twice that). All-gather CP (``run.context_gather``)
    gathers before every forward and reduce-scatters after backward, exposed. Ring attention (torch's
    templated ring) passes the keys and values once per forward (again when recomputed) and once in
    backward, by :attr:`Run.cp_rotate`, and the gradients of the keys and values a step at a time in
    fp32, each behind the next step's kernel, the last one exposed."""
    forwards = 2 if run.recompute == "full" else 1
    if run.context_gather:
        gather = (forwards + 1) * collective_seconds("all_gather", kv * cp, cp, bandwidth, cal)
        return gather, gather
    step_forward, step_backward = core / cp, 2 * core / cp
    if run.cp_rotate == "allgather":  # one gather a pass, waited for at the second step
        one = collective_seconds("all_gather", kv * cp, cp, bandwidth, cal)
        passes = (forwards + 1) * one
        hidden = forwards * max(0.0, one - step_forward) + max(0.0, one - step_backward)
    else:  # a shard a step, each behind a step's kernel
        one = collective_seconds("send", kv, 2, bandwidth, cal)
        passes = (cp - 1) * (forwards + 1) * one
        hidden = (cp - 1) * (forwards * max(0.0, one - step_forward) + max(0.0, one - step_backward))
    grads = collective_seconds("send", kv * 4 / BYTES[run.dtype], 2, bandwidth, cal)
    return passes + cp * grads, hidden + (cp - 1) * max(0.0, grads - step_backward) + grads


@dataclass
class Prediction:
    layout: Layout
    run: Run
    gpu: GPU
    step_s: float
    #: seconds: gemm, attention, memory_bound, optimizer, bubble, exposed_<kind>
    breakdown: dict[str, float]
    communication: dict[str, float]  # seconds of each kind in all, before overlap
    memory: dict[str, int]  # bytes on the GPU holding the most
    tokens_per_s_per_gpu: float
    mfu: float
    microbatches: int
    calibration: Calibration = field(default_factory=reference)
    #: seconds of the memory-bound work by part: norms, ffn (activations), position (rotary),
    #: residual, attention (copies around the kernels), head (final norm, loss), embedding,
    #: float8 (casts), fsdp (copies), kv_repeat
    memory_bound: dict[str, float] = field(default_factory=dict)

    @property
    def memory_per_gpu_bytes(self) -> int:
        return sum(self.memory.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_dict(),
            "run": dataclasses.asdict(self.run),
            "gpu": self.gpu.name,
            "step_s": self.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "memory_per_gpu_bytes": self.memory_per_gpu_bytes,
            "memory": dict(self.memory),
            "breakdown": dict(self.breakdown),
            "memory_bound": dict(self.memory_bound),
            "communication": dict(self.communication),
            "microbatches": self.microbatches,
            "calibration": self.calibration.to_dict(),
        }


def predict(
    spec,
    layout: Layout,
    run: Run,
    gpu: GPU,
    calibration: Calibration | None = None,
    model: Model | None = None,
) -> Prediction:
    """The step time and memory of ``run`` on ``layout`` (see the module's docstring), with
    ``calibration``'s rates (default the reference table's, ``yamlformer.builder.analysis.calibration``).
    Raises a located :class:`LayoutError` for a layout the spec, the batch or the schedule cannot take."""
    check_layout(spec, layout, run.seq_len)
    _check_run(layout, run)
    m = model or Model(spec, run.seq_len, run.dtype)
    cal = calibration or reference()
    tp, pp, cp, ep = layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel, layout.expert_parallel
    v = run.stages_per_rank if run.schedule == "interleaved-1f1b" else 1
    per_rank = run.global_batch // layout.data_parallel_size
    micro = per_rank // run.micro_batch
    mb, act = run.micro_batch, BYTES[run.dtype]
    tokens = mb * run.seq_len // cp  # one rank's tokens of one micro-batch
    counts = m.stage_counts(pp, v)
    intra, inter = gpu.intra_node, gpu.inter_node
    hbm = cal.hbm(gpu)
    shard = layout.shard_size
    linears, traffic = m.linears(tp), m.traffic(tp, run.sequence_parallel)

    def link(stride: int, size: int) -> float:
        return intra if stride * size <= layout.per_node else inter

    redo = {"none": 0.0, "selective": SELECTIVE_RECOMPUTE, "full": 1.0}[run.recompute]
    replays = 0 if run.recompute == "none" else 1  # both policies run every elementwise op again

    def layer_time(i: int) -> dict[str, Any]:
        layer = m.layers[i]
        gemms = gemm_seconds(linears[i], tokens, ep, run, cal, gpu)
        gemm = sum(sum(styles.values()) for styles in gemms.values())
        counted = linear_flops(linears[i], tokens, ep)
        rest = layer["linear"] / layer["tokens"] * tokens / tp - counted  # matmuls no weight shows (none for most)
        if rest > 0 and counted > 0:
            gemm *= 1 + rest / counted
        gemm *= 1 + redo / 3  # the forward's share of the three GEMMs, again
        core = layer["core"] * mb / (tp * cp)
        core_forward, attention = attention_seconds(core, run.seq_len, cp, layer["causal"], run, cal, gpu)
        parts = {}
        for part, t in traffic[i].items():
            forward, backward = t.passes(run.compile)
            parts[part] = tokens * (forward * (1 + replays) + backward) / hbm
        if run.kv_repeat:  # torchtitan's repeat_kv: keys and values copied to every query head, and summed back
            moved = (layer["kv_repeated_per_token"] + layer["kv_per_token"]) / tp
            parts["kv_repeat"] = tokens * moved * (2 + replays) / hbm
        forward, backward = float8_cast_bytes(linears[i], tokens, tp, shard, run)
        parts["float8"] = (forward * (1 + replays) + backward) / hbm
        tp_comm, tp_exposed = tensor_parallel_seconds(gemms, tokens, m.d, tp, link(1, tp), run, cal)
        kv = tokens * kv_per_token(layer, run) / tp
        cp_comm, cp_exposed = (
            context_parallel_seconds(kv, core_forward, cp, link(tp, cp), run, cal) if cp > 1 else (0.0, 0.0)
        )
        ep_comm = 0.0
        if layer["routed"] and ep > 1:
            routed = tokens / tp * layer["routed"][1] * m.d * act  # each (sequence-parallel) token to top_k experts
            calls = 4 + (2 if run.recompute == "full" else 0)  # dispatch and combine, forward and backward
            ep_comm = calls * collective_seconds("all_to_all", routed, ep, link(tp, ep), cal)
        return {
            "gemm": gemm,
            "attention": attention,
            "memory_bound": sum(parts.values()),
            "parts": parts,
            "tp": tp_comm,
            "exposed_tp": tp_exposed,
            "cp": cp_comm,
            "exposed_cp": cp_exposed,
            "ep": ep_comm,
            "exposed_ep": max(0.0, ep_comm - gemm - attention),
        }

    times = {kind: layer_time(kind) for kind in set(m.kinds)}  # identical layers cost the same
    ends = _end_stages(m, run, tokens, tp, cal, gpu, hbm, replays)
    p2p = 2 * v * collective_seconds("send", tokens * m.d * act / tp, 2, link(layout.stage_devices, 2), cal)
    # a tied table's two copies (first and last stage) sum their fp32 gradient shards once a step, exposed
    tie = 0.0
    if m.tied and pp > 1:
        grads = m.embedding / tp / layout.shard_size * 4
        tie = collective_seconds("all_reduce", grads, 2, link(layout.stage_devices * (pp - 1), 2), cal)

    def stage_sum(s: int, key: str) -> float:
        return sum(n * times[kind][key] for kind, n in counts[s].items())

    def end(s: int, key: str) -> float:
        return (ends["first"][key] if s == 0 else 0.0) + (ends["last"][key] if s == pp - 1 else 0.0)

    keys = ("gemm", "attention", "memory_bound", "exposed_tp", "exposed_cp", "exposed_ep")

    def stage_time(s: int) -> float:  # one micro-batch through stage s, forward and backward
        own = sum(stage_sum(s, k) for k in keys) + end(s, "gemm") + end(s, "memory_bound")
        return own + (p2p if pp > 1 else 0)

    shapes = {}  # stages with the same layers (and neither end) take the same time
    for s in range(pp):
        shape = (tuple(sorted(counts[s].items())), s == 0, s == pp - 1)
        if shape not in shapes:
            shapes[shape] = (stage_time(s), s)
    t_micro, slowest = max(shapes.values())
    bubble = bubble_fraction(run.schedule, pp, micro, v) * micro * t_micro
    # FSDP: the stage's parameters gathered in the compute dtype, gradients reduce-scattered in fp32
    dense, experts = _stage_params(m, counts[slowest], slowest, pp, tp, ep)
    gathered = 1 if run.float8 and run.float8_all_gather else act
    rounds = 1 if pp > 1 else micro  # under pipelining FSDP gathers once a step, else every micro-batch
    gathers = 1 if pp > 1 else 2  # forward, and backward again after resharding
    fsdp = hsdp = copies = 0.0
    for elements, group in ((dense, shard), (experts, max(1, shard // ep))):
        if layout.data_parallel != "replicate" and elements:
            copies += rounds * fsdp_copy_bytes(elements, group, gathers, gathered, act)
        if group > 1:
            bw = link(tp, group)
            fsdp += rounds * (
                gathers * collective_seconds("all_gather", elements * gathered, group, bw, cal)
                + collective_seconds("reduce_scatter", elements * 4, group, bw, cal)
            )
    if layout.replicas > 1:
        grads = (dense / shard + experts / max(1, shard // ep)) * 4
        hsdp = collective_seconds("all_reduce", grads, layout.replicas, link(layout.stage_devices, 2), cal)
    # all the stage's kernels (GEMMs, attention, memory-bound work) run while the collectives do
    per_micro = sum(stage_sum(slowest, k) for k in ("gemm", "attention", "memory_bound"))
    per_micro += end(slowest, "gemm") + end(slowest, "memory_bound")
    compute_total = micro * per_micro
    units = max(1, sum(counts[slowest].values()))
    # FSDP's traffic hides behind the compute it prefetches for: every micro-batch's, or under
    # pipelining (one gather and one reduce a step) the first forward's and the last backward's;
    # the first unit's gather and the last one's reduce are exposed
    window = per_micro if pp > 1 else compute_total
    exposed_fsdp = max(0.0, fsdp + hsdp - window) + (fsdp + hsdp) / units
    local = dense / shard + experts / max(1, shard // ep)
    # the step reads and writes the state the optimizer declares (AdamW: two fp32 moments per element)
    optimizer = local * (optimizer_bytes_per_parameter(m.optimizer_bytes(run.optimizer)) + CLIP_BYTES) / hbm
    memory_bound = {
        part: micro * sum(n * times[kind]["parts"].get(part, 0.0) for kind, n in counts[slowest].items())
        for part in {p for t in times.values() for p in t["parts"]}
    }
    for where, stage in (("first", 0), ("last", pp - 1)):
        if slowest == stage:
            for part, seconds in ends[where]["parts"].items():
                memory_bound[part] = memory_bound.get(part, 0.0) + micro * seconds
    memory_bound["fsdp"] = copies / hbm
    breakdown = {
        "gemm": micro * (stage_sum(slowest, "gemm") + end(slowest, "gemm")),
        "attention": micro * stage_sum(slowest, "attention"),
        "memory_bound": sum(memory_bound.values()),
        "optimizer": optimizer,
        "bubble": bubble,
        "exposed_fsdp": exposed_fsdp,
        "exposed_tp": micro * stage_sum(slowest, "exposed_tp"),
        "exposed_cp": micro * stage_sum(slowest, "exposed_cp"),
        "exposed_ep": micro * stage_sum(slowest, "exposed_ep"),
        "exposed_pp": (micro * p2p + tie) if pp > 1 else 0.0,
    }
    communication = {
        "fsdp": fsdp + hsdp,
        "tp": micro * stage_sum(slowest, "tp"),
        "cp": micro * stage_sum(slowest, "cp"),
        "ep": micro * stage_sum(slowest, "ep"),
        "pp": (micro * p2p + tie) if pp > 1 else 0.0,
    }
    step = sum(breakdown.values())
    tokens_per_s = run.global_batch * run.seq_len / step / layout.devices
    return Prediction(
        layout=layout,
        run=run,
        gpu=gpu,
        step_s=step,
        breakdown=breakdown,
        communication=communication,
        memory=memory(m, layout, run),
        tokens_per_s_per_gpu=tokens_per_s,
        mfu=tokens_per_s * m.train_flops_per_token / gpu.peak_flops(run.dtype),
        microbatches=micro,
        calibration=cal,
        memory_bound=memory_bound,
    )


def _end_stages(m: Model, run: Run, tokens: int, tp: int, cal: Calibration, gpu, hbm: float, replays: int) -> dict:
    """One micro-batch's work of the first stage beyond its layers (the embedding: its lookup, and
    its gradient: read the output's gradient, add it into a zero-filled gradient table) and of the
    last (the head's GEMMs in the compute dtype, the final norm, the head's and the loss's
    memory-bound work)."""
    act, d = BYTES[run.dtype], m.d
    lookup = tokens * 4 * act * d + m.embedding / tp * act  # rows read and written, both ways; the table zeroed
    head_t = m.head_traffic(tp, run.sequence_parallel, run.compile_loss)
    forward, backward = head_t.passes(run.compile)
    head_bytes = tokens * (forward * (1 + replays) + backward)
    n = m.head_flops / (2 * m.seq * d) if m.head_flops else 0  # the projection's output width (the vocabulary)
    head_gemm = cal.linear_seconds(run.dtype, tokens, d, max(1, round(n / tp)), gpu) if n else 0.0
    return {
        "first": {"gemm": 0.0, "memory_bound": lookup / hbm, "parts": {"embedding": lookup / hbm}},
        "last": {"gemm": head_gemm, "memory_bound": head_bytes / hbm, "parts": {"head": head_bytes / hbm}},
    }


def _stage_params(m: Model, counts: dict[int, int], stage: int, pp: int, tp: int, ep: int) -> tuple[float, float]:
    """``(dense, expert)`` parameter elements one tensor-parallel, expert-parallel rank of a stage
    gathers: its layers' (experts split over ``ep``, replicated over TP as their plan says), the
    embedding on the first stage, the head (both vocabulary-parallel) and the rest (the final norm,
    replicated) on the last."""
    dense = sum(n * m.layers[k]["params"] for k, n in counts.items()) / tp
    experts = sum(n * m.layers[k]["expert_params"] for k, n in counts.items()) / ep
    if stage == 0:
        dense += m.embedding / tp
    if stage == pp - 1:
        dense += m.head_params / tp + m.rest_params
        if m.tied and pp > 1:  # the tied table's copy the last stage projects with
            dense += m.embedding / tp
    return dense, experts


def memory(m: Model, layout: Layout, run: Run, stage_states: list[int] | None = None) -> dict[str, int]:
    """Bytes on the GPU holding the most, by part (see the module's docstring); ``stage_states``:
    each pipeline rank's parameter, gradient and AdamW bytes counted exactly (``yamlformer.builder.analysis
    .shards.pipeline_rank_states``), in place of the per-layer estimate."""
    tp, pp, cp, ep = layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel, layout.expert_parallel
    v = run.stages_per_rank if run.schedule == "interleaved-1f1b" else 1
    act = BYTES[run.dtype]
    layer_saved, other_saved = m.saved(tp, run.sequence_parallel)
    counts = m.stage_counts(pp, v)
    micro = run.global_batch // layout.data_parallel_size // run.micro_batch
    tokens = run.micro_batch * run.seq_len // cp
    best: dict[str, int] = {}
    # what a compiled loss does not keep (per rank: a tp-th under sequence parallelism)
    loss_saving = m.compiled_loss_saving / (tp if run.sequence_parallel else 1) if run.compile_loss else 0
    # fp32 master weights and gradients, and the optimizer's declared state, per parameter element
    state = 8 + m.optimizer_bytes(run.optimizer) if not stage_states else 0
    for s in range(pp):
        dense, experts = _stage_params(m, counts[s], s, pp, tp, ep)
        shard, expert_shard = layout.shard_size, max(1, layout.shard_size // ep)
        states = stage_states[s] if stage_states else state * (dense / shard + experts / expert_shard)
        unit = max((m.layers[k]["params"] / tp + m.layers[k]["expert_params"] / ep for k in counts[s]), default=0)
        if pp > 1:  # the stage's parameters and gradients stay unsharded through the step
            buffers = (dense + experts) * 2 * act + unit * 4
        else:
            buffers = unit * (3 * act + 4) if layout.shard_size > 1 else 0
        saved = {k: layer_saved[k] * run.micro_batch / cp + gathered_kv(m, k, run, tp, cp) for k in counts[s]}
        largest = max(saved.values(), default=0)
        layers = sum(counts[s].values())
        every = sum(n * saved[k] for k, n in counts[s].items())
        if run.recompute == "full":
            held = layers * tokens * m.d * act / (tp if run.sequence_parallel else 1) + largest
        elif run.recompute == "selective":
            held = SELECTIVE_SAVED * every
        else:
            held = every
        flight = (
            in_flight(run.schedule, pp, micro, v) if s == 0 else max(1.0, in_flight(run.schedule, pp, micro, v) - s)
        )
        activations = held * flight
        head = (other_saved - loss_saving) * run.micro_batch / cp if s == pp - 1 else 0
        # backward's transient: the gradients of the largest block it differentiates at once, the
        # head's logits or one layer's saved tensors, as large as what it saved (with ring
        # attention's gathered keys and values and fp32 gradient buffers)
        transient = max(head, max((saved[k] + ring_buffers(m, k, run, tp, cp) for k in counts[s]), default=0))
        parts = {
            "states": int(states),
            "buffers": int(buffers),
            "activations": int(activations + head),
            "backward_transient": int(transient),
        }
        if sum(parts.values()) > sum(best.values()):
            best = parts
    return best


def gathered_kv(m: Model, kind: int, run: Run, tp: int, cp: int) -> float:
    """Bytes one layer keeps beyond its own share under all-gather context parallelism
    (``Run.context_gather``): the other ``cp - 1`` ranks' keys and values of the micro-batch, one
    tensor-parallel rank's heads of them (0 without it)."""
    if not run.context_gather or cp == 1:
        return 0.0
    return (cp - 1) / cp * run.micro_batch * run.seq_len * m.layers[kind]["kv_per_token"] / tp


def kv_per_token(layer: dict, run: Run) -> int:
    """Key and value bytes per token ring attention passes: the layer's, or once per query head
    under :attr:`Run.kv_repeat`."""
    return layer["kv_repeated_per_token" if run.kv_repeat else "kv_per_token"]


def ring_buffers(m: Model, kind: int, run: Run, tp: int, cp: int) -> float:
    """Bytes ring attention holds while one layer's backward runs (0 without it): the keys and
    values it has gathered (all ``cp`` shards under ``allgather``, the current and the next one
    under ``alltoall``) and three fp32 buffers of their gradients (the sum, the one going out, the
    one coming in)."""
    if cp == 1 or run.context_gather:
        return 0.0
    kv = run.micro_batch * run.seq_len // cp * kv_per_token(m.layers[kind], run) / tp
    return kv * (cp if run.cp_rotate == "allgather" else 2) + 3 * kv * 4 / BYTES[run.dtype]


def _check_run(layout: Layout, run: Run) -> None:
    """The batch and schedule the layout cannot take, as located refusals."""
    dp = layout.data_parallel_size
    if run.global_batch % dp:
        raise LayoutError(
            "global_batch", run.global_batch, f"does not divide over {dp} data-parallel ranks ({layout.describe()})"
        )
    per_rank = run.global_batch // dp
    if per_rank % run.micro_batch:
        raise LayoutError(
            "micro_batch", run.micro_batch, f"does not divide the {per_rank} sequences of one data-parallel rank"
        )
    micro = per_rank // run.micro_batch
    pp = layout.pipeline_parallel
    if run.schedule == "interleaved-1f1b" and pp > 1:
        if run.stages_per_rank < 2:
            raise LayoutError("stages_per_rank", run.stages_per_rank, "interleaved 1F1B needs at least 2 per rank")
        if micro % pp:
            raise LayoutError(
                "micro_batch",
                run.micro_batch,
                f"leaves {micro} micro-batches, which interleaved 1F1B needs a multiple of the {pp} stages",
            )
    if run.seq_len % layout.context_parallel:
        raise LayoutError("context_parallel", layout.context_parallel, f"does not divide seq_len {run.seq_len}")
