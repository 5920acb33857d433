"""The terms of one layer's time in the performance model (``yamlformer.builder.analysis.perf``),
each from a count and a measured rate (torch-free):

* :func:`gemm_seconds`: every linear's forward, input-gradient and weight-gradient GEMMs at the
  calibration's rate for its shape and dtype (float8 where the run converts it);
* :func:`attention_seconds`: the attention kernels' FLOPs at the rate the run's backend reached at
  their lengths (ring attention's causal first step and half-block steps apart);
* :func:`float8_cast_bytes`, :func:`fsdp_copy_bytes`: the HBM bytes of torchao's float8 scaling
  and casts and of FSDP2's copies in and out of its collectives' buffers, beside the blocks' own
  memory-bound bytes (``yamlformer.blocks.configs.traffic``), all over the measured HBM bandwidth;
* :func:`tensor_parallel_seconds`: sequence parallelism's all-gathers and reduce-scatters, and
  what of them async TP leaves exposed (each collective behind the matmul it feeds or follows).
"""

from __future__ import annotations

from yamlformer.builder.analysis.calibration import Calibration, collective_seconds
from yamlformer.builder.analysis.memory import BYTES
from yamlformer.builder.analysis.perf_model import Linear

#: the blocks whose inputs and outputs sequence parallelism gathers and scatters around
SPLIT_BLOCKS = ("attention", "cross_attention", "ffn")


def linear_rows(linear: Linear, tokens: float, ep: int) -> tuple[float, int]:
    """``(rows, count)`` of a linear's GEMMs on one rank: a dense one ``tokens`` rows once; stacked
    experts ``experts / ep`` GEMMs of the tokens' ``top_k`` rows spread over them (balanced)."""
    if not linear.experts:
        return tokens, 1
    local = max(1, linear.experts // ep)
    return tokens * linear.top_k / linear.experts * ep, local


def gemm_dtype(linear: Linear, run) -> str:
    return "fp8" if run.float8 and linear.float8 else run.dtype


def gemm_seconds(linears: tuple[Linear, ...], tokens: float, ep: int, run, cal: Calibration, gpu) -> dict[str, dict]:
    """Per block, ``{style: seconds}`` of its linears' three GEMMs over ``tokens`` rows (one
    micro-batch of one rank)."""
    out: dict[str, dict] = {}
    for linear in linears:
        rows, count = linear_rows(linear, tokens, ep)
        seconds = count * cal.linear_seconds(gemm_dtype(linear, run), rows, linear.k, linear.n, gpu)
        block = out.setdefault(linear.block, {})
        block[linear.style] = block.get(linear.style, 0.0) + seconds
    return out


def linear_flops(linears: tuple[Linear, ...], tokens: float, ep: int) -> float:
    """Forward FLOPs of the linears over ``tokens`` rows."""
    total = 0.0
    for linear in linears:
        rows, count = linear_rows(linear, tokens, ep)
        total += 2 * count * rows * linear.k * linear.n
    return total


def attention_seconds(core: float, seq: int, cp: int, causal: bool, run, cal: Calibration, gpu) -> tuple[float, float]:
    """``(forward, forward and backward)`` seconds of the attention kernels of one rank and
    micro-batch doing ``core`` forward FLOPs over a sequence of ``seq`` split over ``cp`` ranks,
    on the run's backend (the backward twice the forward's FLOPs at the backward rate; full
    recomputation runs the forward again). One call over the whole sequence; all-gather context
    parallelism (``run.context_gather``): the rank's queries against every key; ring attention: a
    causal first step over the rank's own block (``1/cp`` of its work) and ``cp - 1`` half blocks
    (its queries against half the keys or half its queries against them all, half the ranks
    each), each at its own shape's rate."""
    if core <= 0:
        return 0.0, 0.0
    rates = lambda q, k, c: cal.attention_rates(run.attention, q, k, c, gpu)
    local = seq / cp
    if cp == 1 or run.context_gather:
        pieces = [(1.0, *rates(local, seq, causal))]
    elif not causal:
        pieces = [(1.0, *rates(local, local, False))]
    else:
        first = rates(local, local, True)
        halves = [rates(local, local / 2, False), rates(local / 2, local, False)]
        pieces = [(1 / cp, *first)] + [((cp - 1) / cp / 2, *h) for h in halves]
    forward = sum(share * core / f for share, f, _ in pieces)
    backward = sum(share * 2 * core / b for share, _, b in pieces)
    forwards = 2 if run.recompute == "full" else 1
    return forward, forwards * forward + backward


def float8_cast_bytes(linears: tuple[Linear, ...], tokens: float, tp: int, shard: int, run) -> tuple[float, float]:
    """``(forward, backward)`` HBM bytes of torchao's float8 training (dynamic tensorwise scaling)
    for one micro-batch of one rank: each converted linear's input read for its maximum, read
    and written as float8 (``2 a + 1`` per element of ``k``; under sequence parallelism a colwise
    input is cast before it is gathered, a ``tp``-th); backward the same for the output's gradient
    (``n``) and the float8 transposes the weight gradient multiplies (read and written, ``k`` and
    ``n``); the weight cast and transposed once per micro-batch, on the ``shard``-th FSDP holds
    when its all-gathers move float8 (``run.float8_all_gather``)."""
    if not run.float8:
        return 0.0, 0.0
    cast = 2 * BYTES[run.dtype] + 1
    forward = backward = 0.0
    for linear in linears:
        if not linear.float8:
            continue
        gathered = tp if run.sequence_parallel and linear.style == "colwise" else 1
        weight = linear.k * linear.n / (shard if run.float8_all_gather else 1)
        forward += tokens * cast * linear.k / gathered + cast * weight
        backward += tokens * (cast * linear.n + 2 * (linear.k + linear.n)) + 2 * weight
    return forward, backward


def fsdp_copy_bytes(elements: float, shard: int, gathers: int, gathered_bytes: int, act: int) -> float:
    """HBM bytes FSDP2 moves around its collectives for ``elements`` parameters of a rank's stage
    (whole, unsharded): each all-gather casts the fp32 shard into the gather's buffer (read 4,
    write ``gathered_bytes``, a ``shard``-th) and copies the gathered tensor out into the
    parameters (read and write ``gathered_bytes``); the reduce-scatter casts the gradients into its
    fp32 buffer (read ``act``, write 4) and adds its shard into the sharded gradient (read and
    write 4, a ``shard``-th)."""
    gather = elements * (2 * gathered_bytes + (4 + gathered_bytes) / shard)
    reduce = elements * ((act + 4) + 8 / shard)
    return gathers * gather + reduce


def tensor_parallel_seconds(
    gemms: dict[str, dict], tokens: float, d: int, tp: int, bandwidth: float, run, cal: Calibration
) -> tuple[float, float]:
    """``(all, exposed)`` seconds of sequence parallelism's collectives around one layer for one
    micro-batch: around each of its attention and FFN blocks an all-gather of the input (in
    float8 under ``run.float8``) before the colwise linears and a reduce-scatter after the rowwise
    ones, forward (again when fully recomputed) and backward (their gradients: a reduce-scatter
    and an all-gather). Exposed: all of it; under ``run.async_tp`` (torch's micro-pipelined
    collective matmuls) what exceeds the GEMMs each overlaps (the colwise forward, the rowwise
    forward, twice each backward)."""
    if tp == 1:
        return 0.0, 0.0
    act = BYTES[run.dtype]
    whole = tokens * d * act
    gather_forward = collective_seconds("all_gather", whole / act if run.float8 else whole, tp, bandwidth, cal)
    gather = collective_seconds("all_gather", whole, tp, bandwidth, cal)
    scatter = collective_seconds("reduce_scatter", whole, tp, bandwidth, cal)
    forwards = 2 if run.recompute == "full" else 1
    total = exposed = 0.0
    for block in SPLIT_BLOCKS:
        styles = gemms.get(block)
        if not styles or not ({"colwise", "rowwise"} & set(styles)):
            continue
        col, row = styles.get("colwise", 0.0) / 3, styles.get("rowwise", 0.0) / 3  # one forward GEMM each
        total += forwards * (gather_forward + scatter) + scatter + gather
        if run.async_tp:
            exposed += forwards * (max(0.0, gather_forward - col) + max(0.0, scatter - row))
            exposed += max(0.0, scatter - 2 * col) + max(0.0, gather - 2 * row)
        else:
            exposed += forwards * (gather_forward + scatter) + scatter + gather
    return total, exposed
