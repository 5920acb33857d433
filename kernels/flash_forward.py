"""The forward kernel and the online-softmax sweep it shares with the split-K decode kernel
(:mod:`yamlformer.kernels.flash_decode`). Conventions, the interpreter set-up and the helpers every
kernel shares are :mod:`yamlformer.kernels.flash_kernels`'."""

from __future__ import annotations

from .flash_kernels import (
    LOG2E,
    _key_ranges,
    _key_side,
    _masked_scores,
    _query_rows,
    _rows,
    _tile_count,
    _tile_start,
    tl,
    triton,
)


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
        kp, key_ok, bias, kdoc = _key_side(
            kpos, seq_k, KIdx, bias_rows, stride_bn, doc_row, MASKED, HAS_INDEX, HAS_BIAS, HAS_DOCS
        )
        z, _ = _masked_scores(
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
            MASKED,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_CHUNK,
            HAS_ALIBI,
            HAS_BIAS,
            HAS_SOFTCAP,
            HAS_DOCS,
        )
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
    qpos, slope, bias_rows, qdoc = _query_rows(
        offs_m,
        row_ok,
        b,
        h,
        shift,
        SEQ_Q,
        QIdx,
        Alibi,
        Bias,
        stride_bb,
        stride_bh,
        stride_bm,
        Docs,
        stride_db,
        HAS_INDEX,
        HAS_ALIBI,
        HAS_DOCS,
    )
    doc_row = Docs + b * stride_db

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink column first: running max its log2 logit, denominator exp2(0) = 1
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + h) * LOG2E
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qlo = m0 + shift
    qhi = tl.minimum(m0 + BLOCK_M, SEQ_Q) - 1 + shift
    lo, ilo, ihi, hi = _key_ranges(
        qlo,
        qhi,
        SEQ_K,
        window,
        chunk,
        doc_row,
        DocEnds + b * stride_db,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_CHUNK,
        HAS_DOCS,
        HAS_INDEX,
        BLOCK_N,
    )
    for phase in tl.static_range(2):  # the boundary tiles (masked), then the interior ones
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
            phase == 0,
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
            WARP_SPEC and phase == 1,
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
