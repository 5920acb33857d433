"""The dK/dV kernel of the backward: dK and dV per key tile (FlashAttention-2's split), after the dQ
kernel (:mod:`yamlformer.kernels.flash_backward_dq`) has left ``Delta``. Conventions, the
interpreter set-up and the shared helpers are :mod:`yamlformer.kernels.flash_kernels`'; it sweeps a
masked and an interior range of query tiles, the forward's split the other way round."""

from __future__ import annotations

from .flash_kernels import (
    LOG2E,
    _masked_scores,
    _query_ranges,
    _rows,
    _tile_count,
    _tile_start,
    tl,
    triton,
)


# ----------------------------------------------------------------------------------------------
# dk, dv: one key tile of one kv head, the query-head group looped inside
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    b,
    h,
    lse_row,
    delta_row,
    stride_qm,
    stride_dom,
    d_ok,
    dv_ok,
    kp,
    kdoc,
    key_in,
    key_ok,
    slope,
    bias_cols,
    stride_bm,
    dbias_cols,
    doc_row,
    QIdx,
    seq_q,
    seq_k,
    shift,
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
    HAS_DBIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dK, dV contributions of the query tiles ``[lo, hi)`` of query head ``h``, computed keys by
    queries (``(BLOCK_N, BLOCK_M)`` tiles: no register transposes). ``kp``/``kdoc`` (keys, 1) the
    key positions and document starts, ``key_in`` (keys, 1) the keys that exist, ``key_ok`` those
    of them that are not empty slots, ``bias_cols``/``dbias_cols`` (keys,) pointers to each key's
    column of this head's bias and (contiguous, rows ``seq_k`` apart) dbias."""
    offs_m = tl.arange(0, BLOCK_M)
    tiles, first = _tile_count(lo, ilo, ihi, hi, MASKED, BLOCK_M)
    for t in tl.range(0, tiles):
        start_m = _tile_start(t, lo, ilo, ihi, first, MASKED, BLOCK_M)
        rows = start_m + offs_m
        row = tl.minimum(rows, seq_q - 1)  # reads of the row vectors stay in bounds
        q = _rows(q_src, b, h, start_m, offs_m, seq_q, stride_qm, d_ok, TMA, MASKED, EVEN_D, BLOCK_M, BLOCK_D)
        do = _rows(do_src, b, h, start_m, offs_m, seq_q, stride_dom, dv_ok, TMA, MASKED, EVEN_DV, BLOCK_M, BLOCK_DV)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(lse_row + row)
        delta = tl.load(delta_row + row)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M)
        qp = (row + shift)[None, :]  # rows past the end (zero q and dO) contribute nothing
        if HAS_INDEX:
            qp = tl.load(QIdx + row)[None, :]
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(bias_cols[:, None] + row[None, :].to(tl.int64) * stride_bm).to(tl.float32)
        qdoc = qp
        if MASKED and HAS_DOCS:
            qdoc = tl.load(doc_row + tl.maximum(qp, 0), mask=qp >= 0, other=-2)
        zT, thT = _masked_scores(
            qkT,
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
        pT = tl.exp2(zT - lse[None, :])  # 0 where masked or the row is dead (lse +inf)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dsT = pT * (dpT - delta[None, :])  # grad of the post-bias scores (= dbias)
        if HAS_DBIAS:
            db_ptrs = dbias_cols[:, None] + rows[None, :].to(tl.int64) * seq_k
            tl.store(db_ptrs, dsT, mask=key_in & (rows < seq_q)[None, :])
        if HAS_SOFTCAP:
            dsT = dsT * (1.0 - thT * thT)  # d/ds [c * tanh(s / c)]
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


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
    HAS_DBIAS: tl.constexpr,
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
    """dK, dV of one key tile of one kv head. The GROUP query heads sharing that kv head are
    looped here, so their contributions add up in fp32 registers (no atomics, no repeated K/V).
    DK is contiguous (B, H_KV, SEQ_K, HEAD_DIM), DV (B, H_KV, SEQ_K, HEAD_DIM_V); DBias is
    contiguous (B, H, SEQ_Q, SEQ_K). Tiles of key rows with no visible query are stored as 0."""
    pid_n = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    h_kv_count = H // GROUP
    b = pid // h_kv_count
    h_kv = pid % h_kv_count
    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    kpos = start_n + offs_n
    kcol = tl.minimum(kpos, SEQ_K - 1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    k_cols = K + b * stride_kb + h_kv * stride_kh + offs_d * stride_kd
    v_cols = V + b * stride_vb + h_kv * stride_vh + offs_dv * stride_vd
    k = _rows(k_cols, b, h_kv, start_n, offs_n, SEQ_K, stride_kn, d_ok, False, True, EVEN_D, BLOCK_N, BLOCK_D)
    v = _rows(v_cols, b, h_kv, start_n, offs_n, SEQ_K, stride_vn, dv_ok, False, True, EVEN_DV, BLOCK_N, BLOCK_DV)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    key_in = kpos < SEQ_K
    key_ok = key_in
    kp = kpos[:, None]
    if HAS_INDEX:
        kidx = tl.load(KIdx + kcol)
        key_ok = key_in & (kidx >= 0)
        kp = kidx[:, None]
    doc_row = Docs + b * stride_db
    end_row = DocEnds + b * stride_db
    kdoc = kp
    if HAS_DOCS:
        kdoc = tl.load(doc_row + kcol)[:, None]
    shift = SEQ_K - SEQ_Q
    khi = tl.minimum(start_n + BLOCK_N, SEQ_K) - 1
    lo, ilo, ihi, hi = _query_ranges(
        start_n,
        khi,
        SEQ_Q,
        shift,
        window,
        chunk,
        doc_row,
        end_row,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_CHUNK,
        HAS_DOCS,
        HAS_INDEX,
        BLOCK_M,
    )
    key_in = key_in[:, None]
    key_ok = key_ok[:, None]
    for g in range(0, GROUP):
        h = h_kv * GROUP + g
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Alibi + h).to(tl.float32) * LOG2E
        if TMA:
            q_src = Q
            do_src = DO
        else:
            q_src = Q + b * stride_qb + h * stride_qh + offs_d * stride_qd
            do_src = DO + b * stride_dob + h * stride_doh + offs_dv * stride_dod
        rows = (b * H + h) * SEQ_Q
        bias_cols = Bias + b * stride_bb + h * stride_bh + kcol.to(tl.int64) * stride_bn
        dbias_cols = DBias + rows * SEQ_K + kcol
        for phase in tl.static_range(2):  # the boundary tiles (masked), then the interior ones
            dk, dv = _dkdv_tiles(
                dk,
                dv,
                k,
                v,
                q_src,
                do_src,
                b,
                h,
                Lse + rows,
                Delta + rows,
                stride_qm,
                stride_dom,
                d_ok,
                dv_ok,
                kp,
                kdoc,
                key_in,
                key_ok,
                slope,
                bias_cols,
                stride_bm,
                dbias_cols,
                doc_row,
                QIdx,
                SEQ_Q,
                SEQ_K,
                shift,
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
                HAS_DBIAS,
                UPCAST,
                DOT_PREC,
                TMA,
                EVEN_D,
                EVEN_DV,
                BLOCK_M,
                BLOCK_D,
                BLOCK_DV,
            )
    row = (b * h_kv_count + h_kv) * SEQ_K + kpos[:, None]  # (BLOCK_N, 1) row of DK and DV
    tl.store(
        DK + row * HEAD_DIM + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=key_in & d_ok[None, :]
    )
    tl.store(DV + row * HEAD_DIM_V + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=key_in & dv_ok[None, :])
