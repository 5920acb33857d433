"""FlashAttention-2 style Triton kernels: the set-up, the score helpers and the forward; the split-K
decode kernels (FlashDecoding) are :mod:`yamlformer.kernels.flash_decode`, the backward
:mod:`yamlformer.kernels.flash_backward`.

Layout follows the Triton tutorials: ``_``-prefixed ``@triton.jit`` helpers and UPPER_CASE
``tl.constexpr`` parameters. Autotuning, launches and the custom op are in
:mod:`yamlformer.kernels.triton_attention`; the public entry point is :func:`yamlformer.kernels.attention` with
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
  key's document begins (``yamlformer.kernels.attention.document_starts``, non-decreasing along a row); a
  query at position ``p`` keeps the keys whose start equals ``Docs[b, p]``. Since starts never
  decrease, no query of a tile sees a key before its first row's start: the forward and dq
  sweeps begin there, and dk/dv skip the query tiles before their first key's start.
* chunks (``HAS_CHUNK``): a query at position ``p >= 0`` keeps the keys of its chunk,
  ``p // chunk == k // chunk`` (a negative position, a query before the first key, sees none);
  like the window, it is also a block-skipping range: the sweeps cover the chunks of their tile.
* sinks (``HAS_SINKS``): a per-head logit ``Sinks[h]`` (natural-log units, fp32) in every
  row's softmax denominator. The forward's online softmax starts from it (running max the sink's
  log2 logit, denominator 1), so ``LSE`` includes it and a row with no visible key ends with
  output 0 and ``LSE = sink``; the split-K decode adds it once, in the combine. The backward
  kernels need nothing more: ``exp2(z - LSE)`` already is the sinked probability, and the sink's
  own gradient ``-sum_i p_sink(i) * Delta_i`` is a (batch, heads, rows) reduction on the host.

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
    chunk,
    qdoc,
    doc_row,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
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
    if HAS_CHUNK:  # positions >= 0 only: integer division of a negative one differs by backend
        same = (tl.maximum(qpos, 0) // chunk)[:, None] == (kpos // chunk)[None, :]
        valid = valid & same & (qpos >= 0)[:, None]
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
    chunk,
    doc_row,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
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
    if HAS_CHUNK:  # from the first query's chunk start to the last query's chunk end
        lo = tl.maximum(lo, ((tl.maximum(qpos_lo, 0) // chunk) * chunk // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(hi, (tl.maximum(qpos_hi, 0) // chunk + 1) * chunk)
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
    chunk,
    qdoc,
    doc_row,
    lo,
    hi,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
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
            chunk,
            qdoc,
            doc_row,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_CHUNK,
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
    SEQ_Q_BUCKET,
    SEQ_K_BUCKET,  # autotuning key only
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
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
    if HAS_SINKS:  # the sink column first: running max its log2 logit, denominator exp2(0) = 1
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + h) * 1.4426950408889634  # 1/ln(2)
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, hi = _key_range(
        pid_m * BLOCK_M + SEQ_K - SEQ_Q,
        pid_m * BLOCK_M + BLOCK_M - 1 + SEQ_K - SEQ_Q,
        SEQ_K,
        window,
        chunk,
        doc_row,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_CHUNK,
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
        chunk,
        qdoc,
        doc_row,
        lo,
        hi,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_CHUNK,
        HAS_ALIBI,
        HAS_BIAS,
        HAS_SOFTCAP,
        HAS_DOCS,
        UPCAST,
        DOT_PREC,
        BLOCK_N,
    )
    dead = l_i == 0.0  # every key masked (and no sink): output 0, lse +inf
    out = acc / tl.where(dead, 1.0, l_i)[:, None]
    lse = tl.where(dead, float("inf"), m_i + tl.log2(tl.where(dead, 1.0, l_i)))
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(Lse + pid_bh * SEQ_Q + offs_m, lse, mask=row_ok)
