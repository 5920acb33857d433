"""FlashAttention-2 style Triton kernels: forward, split-K decode (FlashDecoding) and backward.

Layout follows the Triton tutorials: ``_``-prefixed ``@triton.jit`` helpers and UPPER_CASE
``tl.constexpr`` parameters. Autotuning, launches and the custom op are in
:mod:`kernels.triton_attention`; the public entry point is :func:`kernels.attention` with
``backend="triton"``. Nothing here imports unless that backend is used.

Conventions shared by every kernel:

* scores live in the log2 domain inside the kernels (``exp2`` is cheaper than ``exp``); the
  saved log-sum-exp ``LSE`` is therefore ``log2(sum(exp2(z)))`` of the log2-scaled scores, and
  ``+inf`` for a row whose keys are all masked, so that the backward's ``exp2(z - lse)`` is 0.
* query row ``i`` sits at absolute position ``i + (seq_k - seq_q)`` (queries are the *last*
  ``seq_q`` positions); key column ``j`` sits at position ``j``.
* score pipeline: ``s = q.k * scale`` -> ``softcap * tanh(s / softcap)`` -> ``+ bias``
  -> ``- slope * (pos_q - pos_k)`` -> masks (``-inf``).
* queries and keys are ``HEAD_DIM`` wide (tiles ``BLOCK_D``), values and outputs ``HEAD_DIM_V``
  (tiles ``BLOCK_DV``): equal for ordinary attention, different for DeepSeek's latent attention.
* documents (``HAS_DOCS``): ``Docs`` is ``(batch, SEQ_K)`` int32, the token index where each
  key's document begins (``kernels.attention.document_starts``, non-decreasing along a row); a
  query at position ``p`` keeps the keys whose start equals ``Docs[b, p]``. Since starts never
  decrease, no query of a tile sees a key before its first row's start: the forward and dq
  sweeps begin there, and dk/dv skip the query tiles before their first key's start.

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


# ----------------------------------------------------------------------------------------------
# jit helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); saturates cleanly to +-1 (exp2 overflow -> inf -> 1)
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2/ln(2)


@triton.jit
def _scores(
    q,
    k,
    qpos,
    kpos,
    row_ok,
    slope,
    bias_ptrs,
    stride_bn,
    seq_k,
    sm_scale,
    softcap,
    window,
    qdoc,
    doc_row,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Masked scores of one (BLOCK_M, BLOCK_N) tile, in the log2 domain.

    ``qdoc`` (BLOCK_M,): the queries' document starts and ``doc_row`` the row of ``Docs`` the
    keys' starts are read from (both unused without ``HAS_DOCS``).
    Returns ``(z2, th)``: ``z2`` the log2-scaled scores (``-inf`` where masked) and ``th`` the
    soft-cap ``tanh`` (needed by the backward; 0 when there is no soft-cap).
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale  # (BLOCK_M, BLOCK_N)
    th = s * 0.0
    if HAS_SOFTCAP:
        th = _tanh(s / softcap)
        s = softcap * th
    valid = row_ok[:, None] & (kpos < seq_k)[None, :]
    if HAS_BIAS:
        b = tl.load(bias_ptrs[:, None] + kpos[None, :].to(tl.int64) * stride_bn, mask=valid, other=0.0)
        s += b.to(tl.float32)
    dist = qpos[:, None] - kpos[None, :]  # (BLOCK_M, BLOCK_N) query minus key position
    if HAS_ALIBI:
        s -= slope[:, None] * dist.to(tl.float32)
    if IS_CAUSAL:
        valid = valid & (dist >= 0)
    if HAS_WINDOW:
        valid = valid & (dist < window)
    if HAS_DOCS:
        kdoc = tl.load(doc_row + kpos, mask=kpos < seq_k, other=-1)  # (BLOCK_N,) document starts
        valid = valid & (qdoc[:, None] == kdoc[None, :])
    z2 = tl.where(valid, s * 1.4426950408889634, float("-inf"))  # 1/ln(2)
    return z2, th


@triton.jit
def _key_range(
    qpos_lo,
    qpos_hi,
    seq_k,
    window,
    doc_row,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key range [lo, hi) that queries at positions [qpos_lo, qpos_hi] may see; lo is
    BLOCK_N-aligned so fully masked tiles are skipped without breaking tile alignment."""
    lo = 0
    hi = seq_k
    if IS_CAUSAL:
        hi = tl.minimum(hi, qpos_hi + 1)
    if HAS_WINDOW:
        lo = tl.maximum(0, qpos_lo - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_DOCS:  # no query sees a key before the first query's document start
        lo = tl.maximum(lo, (tl.load(doc_row + qpos_lo) // BLOCK_N) * BLOCK_N)
    return lo, hi


@triton.jit
def _fwd_inner(
    acc,
    m_i,
    l_i,
    q,
    k_cols,
    v_cols,
    stride_kn,
    stride_vn,
    d_ok,
    dv_ok,
    qpos,
    row_ok,
    slope,
    bias_ptrs,
    stride_bn,
    sm_scale,
    softcap,
    window,
    qdoc,
    doc_row,
    lo,
    hi,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online-softmax sweep over keys [lo, hi) for one tile of query rows.

    ``k_cols``/``v_cols`` are (BLOCK_D,)/(BLOCK_DV,) pointer vectors to the columns of key 0.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        kpos = start_n + offs_n
        k = tl.load(
            k_cols[None, :] + kpos[:, None].to(tl.int64) * stride_kn,
            mask=(kpos < hi)[:, None] & d_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cols[None, :] + kpos[:, None].to(tl.int64) * stride_vn,
            mask=(kpos < hi)[:, None] & dv_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        z2, th = _scores(
            q,
            k,
            qpos,
            kpos,
            row_ok,
            slope,
            bias_ptrs,
            stride_bn,
            hi,
            sm_scale,
            softcap,
            window,
            qdoc,
            doc_row,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_ALIBI,
            HAS_BIAS,
            HAS_SOFTCAP,
            HAS_DOCS,
            DOT_PREC,
        )
        m_new = tl.maximum(m_i, tl.max(z2, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: no NaN
        p = tl.exp2(z2 - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
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
    SEQ_Q_BUCKET,
    SEQ_K_BUCKET,  # autotuning key only
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP  # GQA/MQA: shared kv head, never materialised
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    row_ok = offs_m < SEQ_Q
    qpos = offs_m + (SEQ_K - SEQ_Q)  # queries are the last SEQ_Q positions

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_cols = K + b * stride_kb + h_kv * stride_kh + offs_d * stride_kd
    v_cols = V + b * stride_vb + h_kv * stride_vh + offs_dv * stride_vd
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope += tl.load(Alibi + h).to(tl.float32)
    bias_ptrs = Bias + b * stride_bb + h * stride_bh + offs_m.to(tl.int64) * stride_bm
    doc_row = Docs + b * stride_db
    qdoc = qpos
    if HAS_DOCS:
        qdoc = tl.load(doc_row + qpos, mask=row_ok, other=-2)  # (BLOCK_M,) document starts

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, hi = _key_range(
        pid_m * BLOCK_M + SEQ_K - SEQ_Q,
        pid_m * BLOCK_M + BLOCK_M - 1 + SEQ_K - SEQ_Q,
        SEQ_K,
        window,
        doc_row,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_DOCS,
        BLOCK_N,
    )
    acc, m_i, l_i = _fwd_inner(
        acc,
        m_i,
        l_i,
        q,
        k_cols,
        v_cols,
        stride_kn,
        stride_vn,
        d_ok,
        dv_ok,
        qpos,
        row_ok,
        slope,
        bias_ptrs,
        stride_bn,
        sm_scale,
        softcap,
        window,
        qdoc,
        doc_row,
        lo,
        hi,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_ALIBI,
        HAS_BIAS,
        HAS_SOFTCAP,
        HAS_DOCS,
        UPCAST,
        DOT_PREC,
        BLOCK_N,
    )
    dead = l_i == 0.0  # every key masked: output 0, lse +inf
    out = acc / tl.where(dead, 1.0, l_i)[:, None]
    lse = tl.where(dead, float("inf"), m_i + tl.log2(tl.where(dead, 1.0, l_i)))
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(Lse + pid_bh * SEQ_Q + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# decode (FlashDecoding): split the keys across programs, then combine the partial results
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attn_decode(
    Q,
    K,
    V,
    OPart,
    LPart,
    Bias,
    Alibi,
    Docs,
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
    SEQ_Q_BUCKET,
    SEQ_K_BUCKET,  # autotuning key only
    SPLIT_LEN,
    NUM_SPLITS,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: one split of the keys, all GROUP * SEQ_Q query rows of one kv head, so the
    cache is read once per kv head (not once per query head)."""
    split = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    h_kv_count = H // GROUP
    b = pid // h_kv_count
    h_kv = pid % h_kv_count
    r = tl.arange(0, BLOCK_M)
    row_ok = r < GROUP * SEQ_Q
    h = h_kv * GROUP + r // SEQ_Q  # (BLOCK_M,) query head of each packed row
    i = r % SEQ_Q  # (BLOCK_M,) query index of each packed row
    qpos = i + (SEQ_K - SEQ_Q)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V

    q_ptrs = Q + b * stride_qb + h[:, None] * stride_qh + i[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_cols = K + b * stride_kb + h_kv * stride_kh + offs_d * stride_kd
    v_cols = V + b * stride_vb + h_kv * stride_vh + offs_dv * stride_vd
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope += tl.load(Alibi + h, mask=row_ok, other=0.0).to(tl.float32)
    bias_ptrs = Bias + b * stride_bb + h * stride_bh + i.to(tl.int64) * stride_bm
    doc_row = Docs + b * stride_db
    qdoc = qpos
    if HAS_DOCS:
        qdoc = tl.load(doc_row + qpos, mask=row_ok, other=-2)  # (BLOCK_M,) document starts

    lo, hi = _key_range(SEQ_K - SEQ_Q, SEQ_K - 1, SEQ_K, window, doc_row, IS_CAUSAL, HAS_WINDOW, HAS_DOCS, BLOCK_N)
    lo = tl.maximum(lo, split * SPLIT_LEN)
    hi = tl.minimum(hi, split * SPLIT_LEN + SPLIT_LEN)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc, m_i, l_i = _fwd_inner(
        acc,
        m_i,
        l_i,
        q,
        k_cols,
        v_cols,
        stride_kn,
        stride_vn,
        d_ok,
        dv_ok,
        qpos,
        row_ok,
        slope,
        bias_ptrs,
        stride_bn,
        sm_scale,
        softcap,
        window,
        qdoc,
        doc_row,
        lo,
        hi,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_ALIBI,
        HAS_BIAS,
        HAS_SOFTCAP,
        HAS_DOCS,
        UPCAST,
        DOT_PREC,
        BLOCK_N,
    )
    dead = l_i == 0.0  # nothing visible in this split: weight 0 in the combine
    out = acc / tl.where(dead, 1.0, l_i)[:, None]
    lse = tl.where(dead, float("-inf"), m_i + tl.log2(tl.where(dead, 1.0, l_i)))
    row = (b * H + h) * SEQ_Q + i  # (BLOCK_M,) row of the (B*H*SEQ_Q, NUM_SPLITS, ...) buffers
    o_ptrs = OPart + (row * NUM_SPLITS + split)[:, None] * HEAD_DIM_V + offs_dv[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(LPart + row * NUM_SPLITS + split, lse, mask=row_ok)


@triton.jit
def _attn_decode_combine(
    OPart,
    LPart,
    Out,
    Lse,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    H,
    SEQ_Q,
    HEAD_DIM_V,
    NUM_SPLITS,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // (H * SEQ_Q)
    h = (row // SEQ_Q) % H
    i = row % SEQ_Q
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM_V
    lse_s = tl.load(LPart + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    dead = m == float("-inf")
    w = tl.exp2(lse_s - tl.where(dead, 0.0, m))  # (BLOCK_S,) split weights, 0 when empty
    o = tl.load(
        OPart + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM_V + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(dead, 1.0, total)
    lse = tl.where(dead, float("inf"), m + tl.log2(tl.where(dead, 1.0, total)))
    o_ptrs = Out + b * stride_ob + h * stride_oh + i * stride_om + offs_d * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + row, lse)


# ----------------------------------------------------------------------------------------------
# backward: dk/dv per kv head (the query-head group looped inside), then dq per query head
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DK,
    DV,
    DBias,
    Bias,
    Alibi,
    Docs,
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
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
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
    SEQ_Q_BUCKET,
    SEQ_K_BUCKET,  # autotuning key only
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dK, dV of one key tile of one kv head. The GROUP query heads sharing that kv head are
    looped here, so their contributions add up in fp32 registers (no atomics, no repeated K/V).
    DK is contiguous (B, H_KV, SEQ_K, HEAD_DIM), DV (B, H_KV, SEQ_K, HEAD_DIM_V); DBias is
    contiguous (B, H, SEQ_Q, SEQ_K).
    """
    pid_n = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    h_kv_count = H // GROUP
    b = pid // h_kv_count
    h_kv = pid % h_kv_count
    start_n = pid_n * BLOCK_N
    kpos = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    k_mask = (kpos < SEQ_K)[:, None] & d_ok[None, :]
    v_mask = (kpos < SEQ_K)[:, None] & dv_ok[None, :]
    k = tl.load(
        K + b * stride_kb + h_kv * stride_kh + kpos[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=k_mask,
        other=0.0,
    )
    v = tl.load(
        V + b * stride_vb + h_kv * stride_vh + kpos[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
        mask=v_mask,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # query rows that can see this key tile
    shift = SEQ_K - SEQ_Q
    m_lo = 0
    m_hi = SEQ_Q
    if IS_CAUSAL:
        m_lo = tl.maximum(0, start_n - shift)
        m_lo = (m_lo // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        m_hi = tl.minimum(SEQ_Q, start_n + BLOCK_N - 1 + window - shift)
    doc_row = Docs + b * stride_db
    if HAS_DOCS:  # a query before the first key's document start sees none of these keys
        m_lo = tl.maximum(m_lo, (tl.maximum(0, tl.load(doc_row + start_n) - shift) // BLOCK_M) * BLOCK_M)
    offs_m0 = tl.arange(0, BLOCK_M)
    for g in range(0, GROUP):
        h = h_kv * GROUP + g
        slope = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_ALIBI:
            slope += tl.load(Alibi + h).to(tl.float32)
        q_head = Q + b * stride_qb + h * stride_qh
        do_head = DO + b * stride_dob + h * stride_doh
        for start_m in range(m_lo, m_hi, BLOCK_M):
            offs_m = start_m + offs_m0
            row_ok = offs_m < SEQ_Q
            q = tl.load(
                q_head + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            do = tl.load(
                do_head + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                mask=row_ok[:, None] & dv_ok[None, :],
                other=0.0,
            )
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(Lse + (b * H + h) * SEQ_Q + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(Delta + (b * H + h) * SEQ_Q + offs_m, mask=row_ok, other=0.0)
            bias_ptrs = Bias + b * stride_bb + h * stride_bh + offs_m.to(tl.int64) * stride_bm
            qdoc = offs_m
            if HAS_DOCS:
                qdoc = tl.load(doc_row + offs_m + shift, mask=row_ok, other=-2)  # (BLOCK_M,) starts
            z2, th = _scores(
                q,
                k,
                offs_m + shift,
                kpos,
                row_ok,
                slope,
                bias_ptrs,
                stride_bn,
                SEQ_K,
                sm_scale,
                softcap,
                window,
                qdoc,
                doc_row,
                IS_CAUSAL,
                HAS_WINDOW,
                HAS_ALIBI,
                HAS_BIAS,
                HAS_SOFTCAP,
                HAS_DOCS,
                DOT_PREC,
            )
            p = tl.exp2(z2 - lse[:, None])  # (BLOCK_M, BLOCK_N); 0 where masked or row dead
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            dz = p * (dp - delta[:, None])  # grad of the post-bias scores (= dbias)
            if HAS_DBIAS:
                db_ptrs = DBias + ((b * H + h) * SEQ_Q + offs_m[:, None]) * SEQ_K + kpos[None, :]
                tl.store(db_ptrs, dz, mask=row_ok[:, None] & (kpos < SEQ_K)[None, :])
            if HAS_SOFTCAP:
                dz = dz * (1.0 - th * th)  # d/ds [c * tanh(s / c)]
            dk += tl.dot(tl.trans(dz).to(q.dtype), q, input_precision=DOT_PREC)
    row = (b * h_kv_count + h_kv) * SEQ_K + kpos[:, None]  # (BLOCK_N, 1) row of DK and DV
    tl.store(DK + row * HEAD_DIM + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV + row * HEAD_DIM_V + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DQ,
    Bias,
    Alibi,
    Docs,
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
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
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
    SEQ_Q_BUCKET,
    SEQ_K_BUCKET,  # autotuning key only
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ of one query tile of one query head. DQ is contiguous (B, H, SEQ_Q, HEAD_DIM)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    row_ok = offs_m < SEQ_Q
    q_mask = row_ok[:, None] & d_ok[None, :]
    shift = SEQ_K - SEQ_Q
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
        mask=row_ok[:, None] & dv_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + pid_bh * SEQ_Q + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(Delta + pid_bh * SEQ_Q + offs_m, mask=row_ok, other=0.0)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope += tl.load(Alibi + h).to(tl.float32)
    bias_ptrs = Bias + b * stride_bb + h * stride_bh + offs_m.to(tl.int64) * stride_bm
    k_cols = K + b * stride_kb + h_kv * stride_kh + offs_d * stride_kd
    v_cols = V + b * stride_vb + h_kv * stride_vh + offs_dv * stride_vd
    doc_row = Docs + b * stride_db
    qdoc = offs_m
    if HAS_DOCS:
        qdoc = tl.load(doc_row + offs_m + shift, mask=row_ok, other=-2)  # (BLOCK_M,) document starts
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = _key_range(
        pid_m * BLOCK_M + shift,
        pid_m * BLOCK_M + BLOCK_M - 1 + shift,
        SEQ_K,
        window,
        doc_row,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_DOCS,
        BLOCK_N,
    )
    for start_n in range(lo, hi, BLOCK_N):
        kpos = start_n + offs_n0
        k = tl.load(
            k_cols[None, :] + kpos[:, None].to(tl.int64) * stride_kn,
            mask=(kpos < SEQ_K)[:, None] & d_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cols[None, :] + kpos[:, None].to(tl.int64) * stride_vn,
            mask=(kpos < SEQ_K)[:, None] & dv_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        z2, th = _scores(
            q,
            k,
            offs_m + shift,
            kpos,
            row_ok,
            slope,
            bias_ptrs,
            stride_bn,
            SEQ_K,
            sm_scale,
            softcap,
            window,
            qdoc,
            doc_row,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_ALIBI,
            HAS_BIAS,
            HAS_SOFTCAP,
            HAS_DOCS,
            DOT_PREC,
        )
        p = tl.exp2(z2 - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        dz = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            dz = dz * (1.0 - th * th)  # d/ds [c * tanh(s / c)]
        dq += tl.dot(dz.to(k.dtype), k, input_precision=DOT_PREC)
    dq_ptrs = DQ + (pid_bh * SEQ_Q + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
