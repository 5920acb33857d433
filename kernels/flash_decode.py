"""The split-K decode kernels (FlashDecoding): a few query rows against a long KV cache, the keys
split over programs and the partial results combined. Conventions, the interpreter set-up and the
score helpers are :mod:`yamlformer.kernels.flash_kernels`'."""

from __future__ import annotations

from .flash_kernels import _fwd_inner, _key_range, _scores, tl, triton  # noqa: F401 (the kernels' globals)


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
    chunk,
    SEQ_Q_BUCKET,
    SEQ_K_BUCKET,  # autotuning key only
    SPLIT_LEN,
    NUM_SPLITS,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
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

    lo, hi = _key_range(
        SEQ_K - SEQ_Q, SEQ_K - 1, SEQ_K, window, chunk, doc_row, IS_CAUSAL, HAS_WINDOW, HAS_CHUNK, HAS_DOCS, BLOCK_N
    )
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
    dead = l_i == 0.0  # nothing visible in this split: weight 0 in the combine (sinks join there)
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
    Sinks,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    H,
    SEQ_Q,
    HEAD_DIM_V,
    NUM_SPLITS,
    HAS_SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One query row: the splits' partial outputs weighted by their log-sum-exps, the sink (once,
    here) joining the denominator."""
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
    if HAS_SINKS:
        sink = tl.load(Sinks + h) * 1.4426950408889634  # 1/ln(2): the log2 logit
        m = tl.maximum(m, sink)
    dead = m == float("-inf")
    w = tl.exp2(lse_s - tl.where(dead, 0.0, m))  # (BLOCK_S,) split weights, 0 when empty
    o = tl.load(
        OPart + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM_V + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(w[:, None] * o, 0) / tl.where(dead, 1.0, total)
    lse = tl.where(dead, float("inf"), m + tl.log2(tl.where(dead, 1.0, total)))
    o_ptrs = Out + b * stride_ob + h * stride_oh + i * stride_om + offs_d * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + row, lse)
