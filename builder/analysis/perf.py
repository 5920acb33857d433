"""The performance model: one training step's time and memory per GPU on a 5-D layout (torch-free).

:func:`predict` takes a spec, a :class:`yamlformer.builder.analysis.layout.Layout` (tensor, pipeline,
context, expert parallel, FSDP / HSDP / replicate), a :class:`Run` (sequence, global batch,
micro-batch, recomputation, pipeline schedule, compile, async TP, float8) and a
:class:`yamlformer.builder.analysis.hardware.GPU`, and returns a :class:`Prediction`: the step time in
parts, tokens/s per GPU, MFU and the memory of the GPU holding the most. What it counts:

* **Compute**: each layer's forward FLOPs as ``yamlformer.builder.analysis.estimates`` counts them (the
  attention scores and mix only over the pairs a causal kernel visits), split over the
  tensor-parallel and context-parallel ranks; backward is twice the forward; recomputation adds
  the forward again (``full``) or :data:`SELECTIVE_RECOMPUTE` of the matmuls (``selective``,
  torchtitan's per-op policy: every other matmul recomputed). Matmuls run at
  ``matmul_efficiency`` of the dense peak (float8: the projections at the fp8 peak), attention
  kernels at ``attention_efficiency``.
* **Memory-bound work**: every byte a layer saves for backward is written, read back and its
  gradient written, :data:`ELEMENTWISE_PASSES` passes over HBM (torch.compile fuses
  :data:`COMPILE_FUSION` of them away); the optimizer reads and writes :data:`OPTIMIZER_BYTES`
  bytes per local parameter.
* **Communication**, each collective's bytes over the link it crosses (NVLink when its group
  fits in a node, else the network), ring or tree by group size (:func:`collective_seconds`), at
  ``collective_efficiency`` of the link. Overlapped: FSDP's all-gathers and reduce-scatters (and
  HSDP's all-reduce) with the layers' compute, prefetched one unit ahead, so only the first
  gather, the last reduce and what exceeds the compute are exposed (under pipelining FSDP
  gathers and reduces once a step, behind one micro-batch's compute); ring attention's key/value
  passes and their gradients' with the ring steps' attention kernels, as torch's ring runs them
  (:func:`context_parallel_seconds`: under its default ``allgather`` rotation the whole gather
  behind the first step alone); EP dispatch/combine with the rest of the layer's compute.
  Exposed: tensor parallelism's all-gathers and reduce-scatters (sequence parallel), unless
  ``async_tp`` (then :data:`ASYNC_TP_OVERLAP` of them hide), and the pipeline's sends.
* **Pipeline bubble** (:func:`yamlformer.builder.analysis.schedules.bubble_fraction`): GPipe and 1F1B
  ``(p-1)/m``, interleaved 1F1B ``(p-1)/(v m)``, zero-bubble (ZB-H1, Qi et al. 2023)
  ``(p-1)/(3m)`` of ``m`` micro-batches' time.
* **Memory** (:func:`memory`): 16 bytes per local parameter element sharded over the FSDP group
  (fp32 master weights, fp32 gradients, AdamW's two states), the stage holding the most (the
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

The constants are set once, for every GPU and every run (:data:`CALIBRATION`), and printed with
each prediction; nothing is fitted per row.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from yamlformer.builder.analysis.calibration import (
    ASYNC_TP_OVERLAP,
    BYTES,
    CALIBRATION,
    COMPILE_FUSION,
    ELEMENTWISE_PASSES,
    OPTIMIZER_BYTES,
    SELECTIVE_RECOMPUTE,
    SELECTIVE_SAVED,
    Calibration,
    collective_seconds,
)
from yamlformer.builder.analysis.hardware import GPU
from yamlformer.builder.analysis.layout import Layout, LayoutError, check_layout, experts_of
from yamlformer.builder.analysis.schedules import SCHEDULES, bubble_fraction, in_flight
from yamlformer.builder.analysis.shards import stage_layers

RECOMPUTE = ("none", "selective", "full")
CP_ROTATE = ("allgather", "alltoall")


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
    than passing them round a ring."""

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

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise LayoutError("checkpointing", self.recompute, f"must be one of {', '.join(RECOMPUTE)}")
        if self.schedule not in SCHEDULES:
            raise LayoutError("schedule", self.schedule, f"must be one of {', '.join(SCHEDULES)}")
        if self.dtype not in BYTES:
            raise LayoutError("dtype", self.dtype, f"must be one of {', '.join(BYTES)}")
        if self.cp_rotate not in CP_ROTATE:
            raise LayoutError("cp_rotate", self.cp_rotate, f"must be one of {', '.join(CP_ROTATE)}")
        for name in ("seq_len", "global_batch", "micro_batch", "stages_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(name, value, "must be a positive integer")


def context_parallel_seconds(kv: float, core: float, cp: int, bandwidth: float, run: Run, cal: Calibration):
    """``(all, exposed)`` seconds of one layer's context-parallel traffic for one micro-batch:
    ``kv`` bytes of keys and values per rank, ``core`` seconds of its attention kernel forward
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
    breakdown: dict[str, float]  # seconds: compute, memory_bound, optimizer, bubble, exposed_<kind>
    communication: dict[str, float]  # seconds of each kind in all, before overlap
    memory: dict[str, int]  # bytes on the GPU holding the most
    tokens_per_s_per_gpu: float
    mfu: float
    microbatches: int
    calibration: Calibration = field(default=CALIBRATION)

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
            "communication": dict(self.communication),
            "microbatches": self.microbatches,
            "calibration": dataclasses.asdict(self.calibration),
        }


class Model:
    """What the performance model reads from a spec at one sequence length, once: each layer's
    forward FLOPs (projections and attention core apart), saved bytes, parameters (experts apart),
    the key/value bytes per token and routing, and the embedding and head."""

    def __init__(self, spec, seq_len: int, dtype: str = "bf16", src_len: int | None = None):
        from yamlformer.builder.analysis.estimates import Step, estimate

        self.spec, self.seq, self.dtype, self.src = spec, seq_len, dtype, src_len
        est = estimate(spec, Step(seq_len=seq_len, src_len=src_len, batch=1, dtype=dtype))
        self.estimate = est
        d = spec.d_model
        self.layers = []
        self.kinds: list[int] = []  # per layer, the index of its first identical layer
        first: dict[int, int] = {}
        memory_of = spec.architecture_config.memory_of
        lengths = {
            name: (src_len or seq_len) if name in memory_of.values() else seq_len for name in spec.stacks()
        }  # an encoder runs over the source
        configs = [(name, config) for name, stack in spec.stacks().items() for config in stack.layers()]
        for index, (layer, (name, config)) in enumerate(zip(est.layers, configs)):
            self.kinds.append(first.setdefault(id(config), index))
            attention = config.attention
            projections = attention.projection_flops(d, lengths[name], lengths[name])
            core = layer.kernel_flops - (layer.total_flops - layer.flops.get("attention", 0)) - projections
            routed = experts_of(config.ffn)
            expert_params = (routed[0] * config.ffn.expert.params(d)) if routed else 0
            self.layers.append(
                {
                    "linear": layer.total_flops - layer.flops.get("attention", 0) + projections,
                    "core": max(core, 0),
                    "saved": layer.saved_bytes,
                    "params": layer.total_params - expert_params,
                    "expert_params": expert_params,
                    "kv_per_token": attention.kv_cache(d).bytes_per_token(BYTES[dtype]),
                    # keys and values once per query head (what scores and mix read per pair, a
                    # quarter of its FLOPs each), as a kernel without grouped-query support gets them
                    "kv_repeated_per_token": attention.pair_flops(d) // 2 * BYTES[dtype],
                    "routed": routed,
                }
            )
        self.embedding = est.params.by_component.get("embedding", 0)
        head = est.params.by_component.get("head", 0)
        self.head_params = head if head else 0
        # the rest (the final norm, learned positions): on the last stage, beside the head
        self.rest_params = (
            est.params.total
            - sum(layer["params"] + layer["expert_params"] for layer in self.layers)
            - self.embedding
            - self.head_params
        )
        self.head_flops = est.flops.by_component.get("head", 0)
        self.other_saved = est.memory.activations - sum(layer["saved"] for layer in self.layers)
        # what a compiled loss does not keep of one sequence's (the head's contract, eager minus compiled)
        head_saved = functools.partial(
            spec.head.saved_bytes, d, spec.vocab_size, seq_len, BYTES[dtype], fused=True, position=spec.position
        )
        self.compiled_loss_saving = head_saved() - head_saved(compiled_loss=True)
        self.train_flops_per_token = est.flops.train_per_token
        self.d = d
        self.experts = next((layer["routed"] for layer in self.layers if layer["routed"]), None)
        self._stages: dict[tuple[int, int], list[dict[int, int]]] = {}
        self._whole: dict[int, tuple[list[int], int]] = {}

    def saved(self, tp: int, sequence_parallel: bool) -> tuple[list[int], int]:
        """Bytes one tensor-parallel rank saves for backward per sequence: each layer's, and the rest
        (embedding, final norm, head and loss). Sequence-parallel: a ``tp``-th of the whole; else
        what ``yamlformer.builder.analysis.layout.tensor_parallel_spec`` leaves a rank (inputs, norms and
        logits whole)."""
        whole = [layer["saved"] for layer in self.layers]
        if tp == 1 or sequence_parallel:
            return [b / tp for b in whole], self.other_saved / tp
        if tp not in self._whole:
            from yamlformer.builder.analysis.estimates import Step, estimate
            from yamlformer.builder.analysis.layout import tensor_parallel_spec

            est = estimate(
                tensor_parallel_spec(self.spec, tp), Step(seq_len=self.seq, src_len=self.src, dtype=self.dtype)
            )
            layers = [layer.saved_bytes for layer in est.layers]
            self._whole[tp] = (layers, est.memory.activations - sum(layers))
        return self._whole[tp]

    def stage_counts(self, pp: int, virtual: int = 1) -> list[dict[int, int]]:
        """Per pipeline rank, how many of each kind of layer it holds: the layers split evenly into
        ``pp x virtual`` chunks, rank ``s`` holding chunks ``s, s + pp, ...`` (the looped order)."""
        key = (pp, virtual)
        if key not in self._stages:
            chunks = stage_layers(len(self.layers), pp * virtual)
            out = []
            for s in range(pp):
                counts: dict[int, int] = {}
                for c in range(virtual):
                    for i in chunks[c * pp + s]:
                        counts[self.kinds[i]] = counts.get(self.kinds[i], 0) + 1
                out.append(counts)
            self._stages[key] = out
        return self._stages[key]


def predict(
    spec,
    layout: Layout,
    run: Run,
    gpu: GPU,
    calibration: Calibration = CALIBRATION,
    model: Model | None = None,
) -> Prediction:
    """The step time and memory of ``run`` on ``layout`` (see the module's docstring). Raises a
    located :class:`LayoutError` for a layout the spec, the batch or the schedule cannot take."""
    check_layout(spec, layout, run.seq_len)
    _check_run(layout, run)
    m = model or Model(spec, run.seq_len, run.dtype)
    cal = calibration
    tp, pp, cp, ep = layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel, layout.expert_parallel
    v = run.stages_per_rank if run.schedule == "interleaved-1f1b" else 1
    per_rank = run.global_batch // layout.data_parallel_size
    micro = per_rank // run.micro_batch
    mb, act = run.micro_batch, BYTES[run.dtype]
    tokens = mb * run.seq_len // cp  # one rank's tokens of one micro-batch
    counts = m.stage_counts(pp, v)

    intra, inter = gpu.intra_node, gpu.inter_node

    def link(stride: int, size: int) -> float:
        return intra if stride * size <= layout.per_node else inter

    lin_peak = (
        gpu.peak_flops("fp8") * cal.float8_efficiency
        if run.float8
        else gpu.peak_flops(run.dtype) * cal.matmul_efficiency
    )
    core_peak = gpu.peak_flops(run.dtype) * cal.attention_efficiency
    redo = {"none": 0.0, "selective": SELECTIVE_RECOMPUTE, "full": 1.0}[run.recompute]
    passes = ELEMENTWISE_PASSES * (1 - COMPILE_FUSION if run.compile else 1)
    hbm = gpu.hbm_bandwidth

    def layer_time(i: int) -> dict[str, float]:
        layer = m.layers[i]
        lin = layer["linear"] * mb / (tp * cp) / lin_peak
        core = layer["core"] * mb / (tp * cp) / core_peak
        compute = 3 * (lin + core) + redo * (lin + (core if run.recompute == "full" else 0))
        memory_bound = layer_saved[i] * mb / cp * passes * (1 + redo) / hbm
        # sequence-parallel TP: all-gather + reduce-scatter around attention and the FFN, forward and backward
        tp_bytes = tokens * m.d * act
        tp_calls = 4 + (2 if run.recompute == "full" else 0)  # each of all-gathers and reduce-scatters
        gathered = tp_bytes / act if run.float8 else tp_bytes  # float8 TP gathers its inputs in fp8
        tp_comm = tp_calls * (
            collective_seconds("all_gather", gathered, tp, link(1, tp), cal)
            + collective_seconds("reduce_scatter", tp_bytes, tp, link(1, tp), cal)
        )
        tp_exposed = tp_comm * (1 - ASYNC_TP_OVERLAP if run.async_tp else 1)
        kv = tokens * kv_per_token(layer, run) / tp
        cp_comm, cp_exposed = context_parallel_seconds(kv, core, cp, link(tp, cp), run, cal) if cp > 1 else (0.0, 0.0)
        ep_comm = 0.0
        if layer["routed"] and ep > 1:
            routed = tokens / tp * layer["routed"][1] * m.d * act  # each (sequence-parallel) token to top_k experts
            calls = 4 + (2 if run.recompute == "full" else 0)  # dispatch and combine, forward and backward
            ep_comm = calls * collective_seconds("all_to_all", routed, ep, link(tp, ep), cal)
        ep_exposed = max(0.0, ep_comm - compute)
        return {
            "compute": compute,
            "memory_bound": memory_bound,
            "tp": tp_comm,
            "exposed_tp": tp_exposed,
            "cp": cp_comm,
            "exposed_cp": cp_exposed,
            "ep": ep_comm,
            "exposed_ep": ep_exposed,
        }

    layer_saved, _ = m.saved(tp, run.sequence_parallel)
    times = {kind: layer_time(kind) for kind in set(m.kinds)}  # identical layers cost the same
    head = m.head_flops * mb / (tp * cp) * 3 / lin_peak
    p2p = 2 * v * collective_seconds("send", tokens * m.d * act / tp, 2, link(layout.stage_devices, 2), cal)

    def stage_sum(s: int, key: str) -> float:
        return sum(n * times[kind][key] for kind, n in counts[s].items())

    def stage_time(s: int) -> float:  # one micro-batch through stage s, forward and backward
        keys = ("compute", "memory_bound", "exposed_tp", "exposed_cp", "exposed_ep")
        return sum(stage_sum(s, k) for k in keys) + (head if s == pp - 1 else 0) + (p2p if pp > 1 else 0)

    shapes = {}  # stages with the same layers (and neither end) take the same time
    for s in range(pp):
        shape = (tuple(sorted(counts[s].items())), s == pp - 1)
        if shape not in shapes:
            shapes[shape] = (stage_time(s), s)
    t_micro, slowest = max(shapes.values())
    bubble = bubble_fraction(run.schedule, pp, micro, v) * micro * t_micro
    # FSDP: the stage's parameters gathered in the compute dtype, gradients reduce-scattered in fp32
    stage_params = _stage_params(m, counts[slowest], slowest, pp, tp, ep)
    fsdp = hsdp = 0.0
    shard = layout.shard_size
    if shard > 1:
        dense, experts = stage_params
        rounds = 1 if pp > 1 else micro  # under pipelining FSDP gathers once a step, else every micro-batch
        gathers = 1 if pp > 1 else 2  # forward, and backward again after resharding
        gathered = 1 if run.float8 and run.float8_all_gather else act
        for elements, group in ((dense, shard), (experts, shard // ep)):
            bw = link(tp, group)
            fsdp += rounds * (
                gathers * collective_seconds("all_gather", elements * gathered, group, bw, cal)
                + collective_seconds("reduce_scatter", elements * 4, group, bw, cal)
            )
    if layout.replicas > 1:
        grads = (stage_params[0] / shard + stage_params[1] / max(1, shard // ep)) * 4
        hsdp = collective_seconds("all_reduce", grads, layout.replicas, link(layout.stage_devices, 2), cal)
    per_micro = stage_sum(slowest, "compute") + (head if slowest == pp - 1 else 0)
    compute_total = micro * per_micro
    units = max(1, sum(counts[slowest].values()))
    # FSDP's traffic hides behind the compute it prefetches for: every micro-batch's, or under
    # pipelining (one gather and one reduce a step) the first forward's and the last backward's;
    # the first unit's gather and the last one's reduce are exposed
    window = per_micro if pp > 1 else compute_total
    exposed_fsdp = max(0.0, fsdp + hsdp - window) + (fsdp + hsdp) / units
    local = stage_params[0] / shard + stage_params[1] / max(1, shard // ep)
    optimizer = local * OPTIMIZER_BYTES / hbm
    breakdown = {
        "compute": compute_total,
        "memory_bound": micro * stage_sum(slowest, "memory_bound"),
        "optimizer": optimizer,
        "bubble": bubble,
        "exposed_fsdp": exposed_fsdp,
        "exposed_tp": micro * stage_sum(slowest, "exposed_tp"),
        "exposed_cp": micro * stage_sum(slowest, "exposed_cp"),
        "exposed_ep": micro * stage_sum(slowest, "exposed_ep"),
        "exposed_pp": micro * p2p if pp > 1 else 0.0,
    }
    communication = {
        "fsdp": fsdp + hsdp,
        "tp": micro * stage_sum(slowest, "tp"),
        "cp": micro * stage_sum(slowest, "cp"),
        "ep": micro * stage_sum(slowest, "ep"),
        "pp": micro * p2p if pp > 1 else 0.0,
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
    )


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
    for s in range(pp):
        dense, experts = _stage_params(m, counts[s], s, pp, tp, ep)
        shard, expert_shard = layout.shard_size, max(1, layout.shard_size // ep)
        states = stage_states[s] if stage_states else 16 * (dense / shard + experts / expert_shard)
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
