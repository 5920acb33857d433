"""The dQ kernel of the backward, which also computes ``Delta = rowsum(dO * O)`` and so runs before
the dK/dV kernel (:mod:`yamlformer.kernels.flash_backward`). Conventions, the interpreter set-up and
the shared helpers are :mod:`yamlformer.kernels.flash_kernels`'; it sweeps a masked and an interior
range of key tiles as the forward does."""

from __future__ import annotations

from .flash_kernels import (
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


# ----------------------------------------------------------------------------------------------
# dq (and Delta): one query tile of one query head
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse,
    delta,
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
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dQ contributions of the key tiles ``[lo, hi)``; arguments as the forward's sweep takes them."""
    offs_n = tl.arange(0, BLOCK_N)
    tiles, first = _tile_count(lo, ilo, ihi, hi, MASKED, BLOCK_N)
    for t in tl.range(0, tiles):
        start_n = _tile_start(t, lo, ilo, ihi, first, MASKED, BLOCK_N)
        kpos = start_n + offs_n
        k = _rows(k_src, b, h_kv, start_n, offs_n, seq_k, stride_kn, d_ok, TMA, MASKED, EVEN_D, BLOCK_N, BLOCK_D)
        v = _rows(v_src, b, h_kv, start_n, offs_n, seq_k, stride_vn, dv_ok, TMA, MASKED, EVEN_DV, BLOCK_N, BLOCK_DV)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        kp, key_ok, bias, kdoc = _key_side(
            kpos, seq_k, KIdx, bias_rows, stride_bn, doc_row, MASKED, HAS_INDEX, HAS_BIAS, HAS_DOCS
        )
        z, th = _masked_scores(
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
        p = tl.exp2(z - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - th * th)  # d/ds [c * tanh(s / c)]
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    Out,
    DO,
    Lse,
    Delta,
    DQ,
    Bias,
    Alibi,
    Docs,
    DocEnds,
    QIdx,
    KIdx,
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
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ of one query tile of one query head, and that tile's ``Delta = rowsum(dO * O)`` (fp32,
    (B, H, SEQ_Q)), which the dK/dV kernel launched after reads. DQ is contiguous (B, H, SEQ_Q,
    HEAD_DIM)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    row_ok = offs_m < SEQ_Q
    shift = SEQ_K - SEQ_Q
    q_cols = Q + b * stride_qb + h * stride_qh + offs_d * stride_qd
    do_cols = DO + b * stride_dob + h * stride_doh + offs_dv * stride_dod
    o_cols = Out + b * stride_ob + h * stride_oh + offs_dv * stride_od
    q = _rows(q_cols, b, h, m0, tl.arange(0, BLOCK_M), SEQ_Q, stride_qm, d_ok, False, True, EVEN_D, BLOCK_M, BLOCK_D)
    do = _rows(
        do_cols, b, h, m0, tl.arange(0, BLOCK_M), SEQ_Q, stride_dom, dv_ok, False, True, EVEN_DV, BLOCK_M, BLOCK_DV
    )
    o = _rows(o_cols, b, h, m0, tl.arange(0, BLOCK_M), SEQ_Q, stride_om, dv_ok, False, True, EVEN_DV, BLOCK_M, BLOCK_DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh * SEQ_Q + offs_m, delta, mask=row_ok)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + pid_bh * SEQ_Q + offs_m, mask=row_ok, other=0.0)
    if TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + b * stride_kb + h_kv * stride_kh + offs_d * stride_kd
        v_src = V + b * stride_vb + h_kv * stride_vh + offs_dv * stride_vd
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
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
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
        dq = _dq_tiles(
            dq,
            q,
            do,
            lse,
            delta,
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
            EVEN_D,
            EVEN_DV,
            BLOCK_N,
            BLOCK_D,
            BLOCK_DV,
        )
    dq_ptrs = DQ + (pid_bh * SEQ_Q + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
