"""FlashAttention-2 style Triton kernels: the set-up and the helpers every kernel shares. The forward
is :mod:`yamlformer.kernels.flash_forward`, the split-K decode kernel (FlashDecoding)
:mod:`yamlformer.kernels.flash_decode`, the backward :mod:`yamlformer.kernels.flash_backward_dq` and
:mod:`yamlformer.kernels.flash_backward`.

Layout follows the Triton tutorials: ``_``-prefixed ``@triton.jit`` helpers and UPPER_CASE
``tl.constexpr`` parameters. Launch configs, launches and the custom op are in
:mod:`yamlformer.kernels.triton_attention`; the public entry point is :func:`yamlformer.kernels.attention` with
``backend="triton"``. Nothing here imports unless that backend is used.

Conventions shared by every kernel:

* scores live in the log2 domain inside the kernels (``exp2`` is cheaper than ``exp``); the
  saved log-sum-exp ``LSE`` is therefore ``log2(sum(exp2(z)))`` of the log2-scaled scores, and
  ``+inf`` for a row whose keys are all masked, so that the backward's ``exp2(z - lse)`` is 0.
* query row ``i`` sits at absolute position ``i + (seq_k - seq_q)`` (queries are the *last*
  ``seq_q`` positions); key column ``j`` sits at position ``j``. With token indices
  (``HAS_INDEX``: ``QIdx`` (seq_q,), ``KIdx`` (seq_k,) int) the positions are read from them
  instead, and a key whose index is negative (an empty cache slot) is never visible.
* score pipeline: ``s = q.k * scale`` -> ``softcap * tanh(s / softcap)`` -> ``+ bias``
  -> ``- slope * (pos_q - pos_k)`` -> masks (``-inf``).
* queries and keys are ``HEAD_DIM`` wide (tiles ``BLOCK_D``), values and outputs ``HEAD_DIM_V``
  (tiles ``BLOCK_DV``): equal for ordinary attention, different for DeepSeek's latent attention.
* tiles (:func:`_key_ranges`, :func:`_query_ranges`): the keys (or, for dK/dV, the query rows) a
  program sweeps are three ranges, ``[lo, ilo)`` and ``[ihi, hi)`` masked and ``[ilo, ihi)``
  *interior*: whole tiles inside the tensors that every row of the program's tile sees under every
  mask (causal, window, chunk, documents). Interior tiles load without bounds masks and compute
  no mask at all, whatever the variant (ALiBi, a bias and soft-capping still apply there: they
  are scores, not masks); only the diagonal and boundary tiles pay for masking. Token indices
  have no structure to skip by, so all their tiles are masked.
* ``TMA``: tiles are loaded through 4-D tensor descriptors (``triton.tools.tensor_descriptor``,
  the Hopper bulk tensor copy engine; the descriptor zero-fills past each dimension's end) given
  in place of the ``Q``/``K``/``V``/``DO`` pointers; else through pointers. ``WARP_SPEC``: the
  interior loop is warp-specialized (``tl.range(..., warp_specialize=True)``).
* documents (``HAS_DOCS``): ``Docs`` is ``(batch, SEQ_K)`` int32, the token index where each
  key's document begins (``yamlformer.kernels.attention.document_starts``, non-decreasing along a
  row), ``DocEnds`` where it ends (exclusive); a query at position ``p`` keeps the keys whose start
  equals ``Docs[b, p]``. Since starts never decrease, the queries at positions ``qlo..qhi`` see no
  key before ``Docs[qlo]`` nor from ``DocEnds[qhi]`` on, and every one of them sees the keys in
  ``[Docs[qhi], DocEnds[qlo])``: tiles outside the first range are skipped, tiles inside the
  second are interior.
* chunks (``HAS_CHUNK``): a query at position ``p >= 0`` keeps the keys of its chunk,
  ``p // chunk == k // chunk`` (a negative position, a query before the first key, sees none);
  like the window, it is also a block-skipping range: the sweeps cover the chunks of their tile.
* sinks (``HAS_SINKS``): a per-head logit ``Sinks[h]`` (natural-log units, fp32) in every
  row's softmax denominator. The forward's online softmax starts from it (running max the sink's
  log2 logit, denominator 1), so ``LSE`` includes it and a row with no visible key ends with
  output 0 and ``LSE = sink``; the split-K decode adds it once, in the combine. The backward
  kernels need nothing more: ``exp2(z - LSE)`` already is the sinked probability, and the sink's
  own gradient ``-sum_i p_sink(i) * Delta_i`` is a (batch, heads, rows) reduction on the host.
* integer division only ever sees non-negative operands (Triton's rounds toward zero, the
  interpreter's toward minus infinity).

The interpreter: Triton reads ``TRITON_INTERPRET`` whenever ``@triton.jit`` *decorates* a
function (``triton.knobs.runtime.interpret`` in ``triton/runtime/jit.py``): our kernels, but also
``triton.language``'s own helpers (``tl.zeros``, ``tl.max``...), decorated when ``triton`` is
first imported. On a machine without CUDA, and unless the user set it (``0`` opts out),
:func:`interpreting` sets ``TRITON_INTERPRET=1`` while this module and the other kernel modules
are decorated (from here to the end of ``yamlformer.kernels.flash_launch``'s imports) and
while a kernel runs on CPU tensors; the environment is as it was otherwise, so importing
``yamlformer.kernels``, or using only its PyTorch paths, leaves it alone. If something imported
``triton`` earlier, :func:`_interpret_triton_stdlib` re-wraps its helpers for the interpreter.
Under the interpreter ``bf16`` dot products are computed on raw ``uint16`` storage, so every tile
is upcast to fp32 there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch

#: Triton's interpreter runs our kernels here: no CUDA, and the user did not say otherwise
INTERPRETER = "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available()


@contextlib.contextmanager
def interpreting():
    """``TRITON_INTERPRET=1`` for the duration where :data:`INTERPRETER` (Triton decorating or
    running our kernels on a machine without CUDA), and the variable as it was after."""
    if not INTERPRETER or os.environ.get("TRITON_INTERPRET") == "1":
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TRITON_INTERPRET", None)


def interpreted(fn):
    """``fn`` run :func:`interpreting` (a launcher of our kernels; ``fn`` itself where Triton
    compiles, so a GPU's launches pay nothing)."""
    if not INTERPRETER:
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with interpreting():
            return fn(*args, **kwargs)

    return run


#: open from here until every kernel module is decorated (``yamlformer.kernels.flash_launch`` closes it)
DECORATING = interpreting()
DECORATING.__enter__()

# after the interpreter is set: triton decorates its own helpers as it loads
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

try:  # what the decorators below will see; triton < 3.4 has no knobs and reads the env var
    INTERPRET = bool(triton.knobs.runtime.interpret)
except AttributeError:
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpret_triton_stdlib():
    """Make ``triton.language``'s own ``@jit`` functions (``tl.zeros``, ``tl.max``, ``tl.sum``...)
    interpretable when ``triton`` was imported before ``TRITON_INTERPRET`` was set (for example by
    ``torch.utils.flop_counter``): they were then decorated as compiled ``JITFunction``s, which
    refuse to run inside an interpreted kernel. Each is re-wrapped once, everywhere it is bound,
    as the ``InterpretedFunction`` an interpreter-mode import would have made. Only done on
    machines without CUDA, where no compiled Triton kernel can run anyway."""

    if isinstance(tl.zeros, InterpretedFunction):
        return
    wrapped = {}
    owners = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language")]
    for owner in owners + [tl.core.tensor]:
        for name, obj in list(vars(owner).items()):
            if isinstance(obj, JITFunction):
                if id(obj) not in wrapped:
                    wrapped[id(obj)] = InterpretedFunction(obj.fn)
                setattr(owner, name, wrapped[id(obj)])


if INTERPRET and not torch.cuda.is_available():
    _interpret_triton_stdlib()


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # 1 / ln(2): natural-log units to log2


# ----------------------------------------------------------------------------------------------
# jit helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); saturates cleanly to +-1 (exp2 overflow -> inf -> 1)
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2/ln(2)


@triton.jit
def _rows(
    src,
    b,
    h,
    row0,
    offs,
    n_rows,
    stride_row,
    cols_ok,
    TMA: tl.constexpr,
    MASK: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Rows ``row0 .. row0 + BLOCK_R`` of one (batch, head) slice as a (BLOCK_R, BLOCK_C) tile:
    ``src`` a 4-D tensor descriptor (``TMA``; zeros past the ends), else the (BLOCK_C,) pointers to
    the slice's row 0 (``MASK``: rows from ``n_rows`` on read as 0; ``EVEN``: every column of the
    tile exists, else ``cols_ok`` says which)."""
    if TMA:
        tile = src.load([b.to(tl.int32), h.to(tl.int32), row0.to(tl.int32), 0]).reshape([BLOCK_R, BLOCK_C])
    else:
        rows = row0 + offs
        ptrs = src[None, :] + rows[:, None].to(tl.int64) * stride_row
        if MASK:
            ok = rows[:, None] < n_rows
            if not EVEN:
                ok = ok & cols_ok[None, :]
            tile = tl.load(ptrs, mask=ok, other=0.0)
        elif EVEN:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    return tile


@triton.jit
def _score(
    qk,
    qp,
    kp,
    bias,
    slope,
    sm_scale,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """Log2-domain scores of a tile from its dot products ``qk``. ``qp``/``kp`` (query and key
    positions) and ``bias`` (natural units) broadcast to ``qk``'s shape, in either orientation
    (rows queries, or rows keys for dK/dV); ``slope`` is the ALiBi slope times log2(e). Returns
    ``(z, th)``: ``th`` the soft-cap's tanh, which the backward needs (``qk`` without one)."""
    th = qk
    if HAS_SOFTCAP:
        th = _tanh(qk * (sm_scale / softcap))
        z = th * (softcap * LOG2E)
    else:
        z = qk * (sm_scale * LOG2E)
    if HAS_BIAS:
        z += bias * LOG2E
    if HAS_ALIBI:
        z -= slope * (qp - kp).to(tl.float32)
    return z, th


@triton.jit
def _visible(
    qp,
    kp,
    key_ok,
    qdoc,
    kdoc,
    window,
    chunk,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """The scores of a boundary tile the masks keep; ``key_ok``: the keys that exist. Operands
    broadcast as :func:`_score`'s."""
    keep = key_ok
    dist = qp - kp
    if IS_CAUSAL:
        keep = keep & (dist >= 0)
    if HAS_WINDOW:
        keep = keep & (dist < window)
    if HAS_CHUNK:  # positions >= 0 only (module doc); a query before the first key sees none
        keep = keep & (qp >= 0) & ((tl.maximum(qp, 0) // chunk) == (tl.maximum(kp, 0) // chunk))
    if HAS_DOCS:
        keep = keep & (qdoc == kdoc)
    return keep


@triton.jit
def _aligned(lo, ilo, ihi, hi, size, BLOCK: tl.constexpr):
    """Raw ranges (module doc: tiles) on tile boundaries: ``lo`` down, the interior ``[ilo, ihi)``
    inward and whole tiles under ``size`` only; an empty interior sits inside ``[lo, hi)``."""
    hi = tl.maximum(hi, lo)  # nothing visible: every range empty
    lo = tl.maximum(lo, 0) // BLOCK * BLOCK
    top = tl.cdiv(hi, BLOCK) * BLOCK
    ilo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(ilo, 0), BLOCK) * BLOCK, lo), top)
    ihi = tl.maximum(tl.minimum(tl.maximum(ihi, 0), size) // BLOCK * BLOCK, ilo)
    return lo, ilo, ihi, hi


@triton.jit
def _tile_count(lo, ilo, ihi, hi, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """``(tiles, first)``: how many tiles a sweep visits, the masked one ``[lo, ilo)`` then
    ``[ihi, hi)`` (``first`` of them in the first range) or the interior one ``[ilo, ihi)``."""
    if MASKED:
        first = (ilo - lo) // BLOCK
        tiles = first + tl.cdiv(tl.maximum(hi - ihi, 0), BLOCK)
    else:
        first = ilo * 0
        tiles = (ihi - ilo) // BLOCK
    return tiles, first


@triton.jit
def _tile_start(t, lo, ilo, ihi, first, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """The first row of a sweep's ``t``-th tile (:func:`_tile_count`)."""
    if MASKED:
        start = tl.where(t < first, lo + t * BLOCK, ihi + (t - first) * BLOCK)
    else:
        start = ilo + t * BLOCK
    return tl.multiple_of(start, BLOCK)


@triton.jit
def _key_ranges(
    qlo,
    qhi,
    seq_k,
    window,
    chunk,
    doc_row,
    end_row,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``(lo, ilo, ihi, hi)``: the keys ``[lo, hi)`` some query at positions ``qlo..qhi`` (``qhi``
    the last real one, below ``seq_k``) may see, and the interior ``[ilo, ihi)`` every one of them
    sees, in whole ``BLOCK_N`` tiles (module doc: tiles)."""
    lo = qlo * 0
    hi = lo + seq_k
    ilo = lo
    ihi = hi
    if HAS_INDEX:  # positions in no order: every key, every tile masked
        ihi = ilo
    else:
        if IS_CAUSAL:
            hi = tl.minimum(hi, qhi + 1)
            ihi = tl.minimum(ihi, qlo + 1)
        if HAS_WINDOW:
            lo = tl.maximum(lo, qlo - window + 1)
            ilo = tl.maximum(ilo, qhi - window + 1)
        if HAS_CHUNK:  # from the first query's chunk to the last's; interior only within one chunk
            first = tl.maximum(qlo, 0) // chunk * chunk
            last = tl.maximum(qhi, 0) // chunk * chunk
            lo = tl.maximum(lo, first)
            hi = tl.minimum(hi, last + chunk)
            ilo = tl.maximum(ilo, last)
            ihi = tl.minimum(ihi, tl.where(qlo < 0, 0, first + chunk))
        if HAS_DOCS:
            lo = tl.maximum(lo, tl.load(doc_row + tl.maximum(qlo, 0)))
            hi = tl.minimum(hi, tl.load(end_row + qhi))
            ilo = tl.maximum(ilo, tl.load(doc_row + qhi))
            ihi = tl.minimum(ihi, tl.load(end_row + tl.maximum(qlo, 0)))
    return _aligned(lo, ilo, ihi, hi, seq_k, BLOCK_N)


@triton.jit
def _query_ranges(
    klo,
    khi,
    seq_q,
    shift,
    window,
    chunk,
    doc_row,
    end_row,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """:func:`_key_ranges` the other way round, for dK/dV: the query rows (row ``r`` at position
    ``r + shift``) that may see a key at ``klo..khi`` (``khi`` the last real one), and the interior
    rows that see all of them, in whole ``BLOCK_M`` tiles."""
    plo = klo * 0 + shift  # positions, [plo, phi)
    phi = plo + seq_q
    iplo = plo
    iphi = phi
    if HAS_INDEX:  # positions in no order: every query row, every tile masked
        iphi = iplo
    else:
        if IS_CAUSAL:
            plo = tl.maximum(plo, klo)
            iplo = tl.maximum(iplo, khi)
        if HAS_WINDOW:
            phi = tl.minimum(phi, khi + window)
            iphi = tl.minimum(iphi, klo + window)
        if HAS_CHUNK:  # the queries of the chunks the keys span (positions >= 0 only)
            first = klo // chunk * chunk
            last = khi // chunk * chunk
            plo = tl.maximum(plo, first)
            phi = tl.minimum(phi, last + chunk)
            iplo = tl.maximum(iplo, last)
            iphi = tl.minimum(iphi, first + chunk)
        if HAS_DOCS:
            plo = tl.maximum(plo, tl.load(doc_row + klo))
            phi = tl.minimum(phi, tl.load(end_row + khi))
            iplo = tl.maximum(iplo, tl.load(doc_row + khi))
            iphi = tl.minimum(iphi, tl.load(end_row + klo))
    return _aligned(plo - shift, iplo - shift, iphi - shift, phi - shift, seq_q, BLOCK_M)


@triton.jit
def _query_rows(
    rows,
    live,
    b,
    h,
    shift,
    seq_q,
    QIdx,
    Alibi,
    Bias,
    stride_bb,
    stride_bh,
    stride_bm,
    Docs,
    stride_db,
    HAS_INDEX: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """What a tile of query rows (``rows``: (R,) row indices, ``live`` the real ones; ``h`` their
    head, one or one per row) needs besides the queries: ``(positions, slopes, bias rows, document
    starts)``, the slopes (R, 1) ALiBi's times log2(e), the bias rows (R,) pointers to each row's
    bias; rows past the end stand for the last one (they are never stored)."""
    row = tl.minimum(rows, seq_q - 1)
    qpos = row + shift
    if HAS_INDEX:
        qpos = tl.load(QIdx + row)
    slope = qpos.to(tl.float32) * 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + h + row * 0).to(tl.float32) * LOG2E
    bias_rows = Bias + b * stride_bb + h * stride_bh + row.to(tl.int64) * stride_bm
    qdoc = qpos
    if HAS_DOCS:
        qdoc = tl.load(Docs + b * stride_db + tl.maximum(qpos, 0), mask=live & (qpos >= 0), other=-2)
    return qpos, slope[:, None], bias_rows, qdoc


@triton.jit
def _key_side(
    kpos,
    seq_k,
    KIdx,
    bias_rows,
    stride_bn,
    doc_row,
    MASKED: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """For a tile of keys (``kpos``) against query rows (``bias_rows``, :func:`_query_rows`): the
    keys' positions and which of them count (both (1, keys)), the bias tile and the keys' document
    starts (read on boundary tiles only), every read in bounds."""
    kcol = tl.minimum(kpos, seq_k - 1)
    kp = kpos[None, :]
    key_ok = (kpos < seq_k)[None, :]
    if HAS_INDEX:
        kidx = tl.load(KIdx + kcol)
        kp = kidx[None, :]
        key_ok = key_ok & (kidx >= 0)[None, :]
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_rows[:, None] + kcol[None, :].to(tl.int64) * stride_bn).to(tl.float32)
    kdoc = kp
    if MASKED and HAS_DOCS:
        kdoc = tl.load(doc_row + kcol)[None, :]
    return kp, key_ok, bias, kdoc


@triton.jit
def _masked_scores(
    qk,
    qp,
    kp,
    key_ok,
    bias,
    slope,
    qdoc,
    kdoc,
    sm_scale,
    softcap,
    window,
    chunk,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """:func:`_score`, and on a boundary tile (``MASKED``) :func:`_visible`'s masks as ``-inf``."""
    z, th = _score(qk, qp, kp, bias, slope, sm_scale, softcap, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI)
    if MASKED:
        keep = _visible(qp, kp, key_ok, qdoc, kdoc, window, chunk, IS_CAUSAL, HAS_WINDOW, HAS_CHUNK, HAS_DOCS)
        z = tl.where(keep, z, float("-inf"))
    return z, th
