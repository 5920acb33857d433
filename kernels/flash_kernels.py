"""FlashAttention-2 style Triton kernels: the set-up, the helpers every kernel shares and the forward;
the split-K decode kernel (FlashDecoding) is :mod:`yamlformer.kernels.flash_decode`, the backward
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
first imported. On a machine without CUDA, ``kernels/__init__.py`` and this module set
``TRITON_INTERPRET=1`` (``setdefault``: an explicit user value wins, ``0`` opts out) before any
decorator here runs; if something imported ``triton`` earlier, :func:`_interpret_triton_stdlib`
re-wraps its helpers for the interpreter. Under the interpreter ``bf16`` dot products are
computed on raw ``uint16`` storage, so every tile is upcast to fp32 there.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the @triton.jit decorators below
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

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
    import sys

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

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
def _fwd_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_src,
    v_src,
    b,
    h_kv,
    stride_kn,
    stride_vn,
    d_ok,
    dv_ok,
    qp,
    qdoc,
    slope,
    bias_rows,
    stride_bn,
    doc_row,
    KIdx,
    seq_k,
    sm_scale,
    softcap,
    window,
    chunk,
    lo,
    ilo,
    ihi,
    hi,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Online-softmax sweep over the key tiles ``[lo, hi)`` for one tile of query rows: masked
    (``MASKED``: boundary tiles) or not (interior tiles: no bounds, no masks). ``qp`` (rows, 1) the
    query positions, ``qdoc`` (rows, 1) their document starts, ``slope`` the rows' ALiBi slope times
    log2(e), ``bias_rows`` (rows,) pointers to each row's bias (rows past the end clamped to the
    last); ``k_src``/``v_src`` as :func:`_rows` takes them."""
    offs_n = tl.arange(0, BLOCK_N)
    tiles, first = _tile_count(lo, ilo, ihi, hi, MASKED, BLOCK_N)
    for t in tl.range(0, tiles, warp_specialize=WARP_SPEC):
        start_n = _tile_start(t, lo, ilo, ihi, first, MASKED, BLOCK_N)
        kpos = start_n + offs_n
        k = _rows(k_src, b, h_kv, start_n, offs_n, seq_k, stride_kn, d_ok, TMA, MASKED, EVEN_D, BLOCK_N, BLOCK_D)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        kcol = tl.minimum(kpos, seq_k - 1)  # reads of the bias, documents and indices stay in bounds
        kp = kpos[None, :]
        if HAS_INDEX:
            kidx = tl.load(KIdx + kcol)
            kp = kidx[None, :]
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(bias_rows[:, None] + kcol[None, :].to(tl.int64) * stride_bn).to(tl.float32)
        z, th = _score(qk, qp, kp, bias, slope, sm_scale, softcap, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI)
        if MASKED:
            key_ok = kpos < seq_k
            if HAS_INDEX:
                key_ok = key_ok & (kidx >= 0)
            kdoc = kp
            if HAS_DOCS:
                kdoc = tl.load(doc_row + kcol)[None, :]
            keep = _visible(
                qp, kp, key_ok[None, :], qdoc, kdoc, window, chunk, IS_CAUSAL, HAS_WINDOW, HAS_CHUNK, HAS_DOCS
            )
            z = tl.where(keep, z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        if MASKED or HAS_BIAS:  # a row may have nothing visible yet (-inf): keep exp2 finite
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(z - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _rows(v_src, b, h_kv, start_n, offs_n, seq_k, stride_vn, dv_ok, TMA, MASKED, EVEN_DV, BLOCK_N, BLOCK_DV)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    Out,
    Lse,
    Bias,
    Alibi,
    Docs,
    DocEnds,
    QIdx,
    KIdx,
    Sinks,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    stride_db,
    H,
    GROUP,
    SEQ_Q,
    SEQ_K,
    HEAD_DIM,
    HEAD_DIM_V,
    sm_scale,
    softcap,
    window,
    chunk,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One tile of query rows of one query head: the masked key tiles before the interior, the
    interior, the masked ones after (module doc: tiles)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP  # GQA/MQA: shared kv head, never materialised
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    row_ok = offs_m < SEQ_Q
    shift = SEQ_K - SEQ_Q  # queries are the last SEQ_Q positions
    qpos = offs_m + shift
    if HAS_INDEX:
        qpos = tl.load(QIdx + tl.minimum(offs_m, SEQ_Q - 1))
    if TMA:
        q = Q.load([b.to(tl.int32), h.to(tl.int32), m0, 0]).reshape([BLOCK_M, BLOCK_D])
        k_src = K
        v_src = V
    else:
        q_cols = Q + b * stride_qb + h * stride_qh + offs_d * stride_qd
        q = _rows(
            q_cols, b, h, m0, tl.arange(0, BLOCK_M), SEQ_Q, stride_qm, d_ok, False, True, EVEN_D, BLOCK_M, BLOCK_D
        )
        k_src = K + b * stride_kb + h_kv * stride_kh + offs_d * stride_kd
        v_src = V + b * stride_vb + h_kv * stride_vh + offs_dv * stride_vd
    if UPCAST:
        q = q.to(tl.float32)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + h).to(tl.float32) * LOG2E
    bias_rows = Bias + b * stride_bb + h * stride_bh + tl.minimum(offs_m, SEQ_Q - 1).to(tl.int64) * stride_bm
    doc_row = Docs + b * stride_db
    end_row = DocEnds + b * stride_db
    qdoc = qpos
    if HAS_DOCS:
        qdoc = tl.load(doc_row + tl.maximum(qpos, 0), mask=row_ok & (qpos >= 0), other=-2)  # (BLOCK_M,) starts

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink column first: running max its log2 logit, denominator exp2(0) = 1
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + h) * LOG2E
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qlo = m0 + shift
    qhi = tl.minimum(m0 + BLOCK_M, SEQ_Q) - 1 + shift
    lo, ilo, ihi, hi = _key_ranges(
        qlo, qhi, SEQ_K, window, chunk, doc_row, end_row, IS_CAUSAL, HAS_WINDOW, HAS_CHUNK, HAS_DOCS, HAS_INDEX, BLOCK_N
    )
    acc, m_i, l_i = _fwd_tiles(
        acc,
        m_i,
        l_i,
        q,
        k_src,
        v_src,
        b,
        h_kv,
        stride_kn,
        stride_vn,
        d_ok,
        dv_ok,
        qpos[:, None],
        qdoc[:, None],
        slope,
        bias_rows,
        stride_bn,
        doc_row,
        KIdx,
        SEQ_K,
        sm_scale,
        softcap,
        window,
        chunk,
        lo,
        ilo,
        ihi,
        hi,
        True,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_CHUNK,
        HAS_ALIBI,
        HAS_BIAS,
        HAS_SOFTCAP,
        HAS_DOCS,
        HAS_INDEX,
        UPCAST,
        DOT_PREC,
        TMA,
        False,
        EVEN_D,
        EVEN_DV,
        BLOCK_N,
        BLOCK_D,
        BLOCK_DV,
    )
    acc, m_i, l_i = _fwd_tiles(
        acc,
        m_i,
        l_i,
        q,
        k_src,
        v_src,
        b,
        h_kv,
        stride_kn,
        stride_vn,
        d_ok,
        dv_ok,
        qpos[:, None],
        qdoc[:, None],
        slope,
        bias_rows,
        stride_bn,
        doc_row,
        KIdx,
        SEQ_K,
        sm_scale,
        softcap,
        window,
        chunk,
        lo,
        ilo,
        ihi,
        hi,
        False,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_CHUNK,
        HAS_ALIBI,
        HAS_BIAS,
        HAS_SOFTCAP,
        HAS_DOCS,
        HAS_INDEX,
        UPCAST,
        DOT_PREC,
        TMA,
        WARP_SPEC,
        EVEN_D,
        EVEN_DV,
        BLOCK_N,
        BLOCK_D,
        BLOCK_DV,
    )
    dead = l_i == 0.0  # every key masked (and no sink): output 0, lse +inf
    out = acc / tl.where(dead, 1.0, l_i)[:, None]
    lse = tl.where(dead, float("inf"), m_i + tl.log2(tl.where(dead, 1.0, l_i)))
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(Lse + pid_bh * SEQ_Q + offs_m, lse, mask=row_ok)
