"""The backward kernels: dK and dV per key tile, dQ per query tile (FlashAttention-2's split).
Conventions, the interpreter set-up and the score helpers are :mod:`yamlformer.kernels.flash_kernels`'."""

from __future__ import annotations

from .flash_kernels import _key_range, _scores, tl, triton


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
    if HAS_CHUNK:  # the queries of the chunks this key tile spans
        chunk_lo = (start_n // chunk) * chunk - shift  # first query row of the first key's chunk
        m_lo = tl.maximum(m_lo, (tl.maximum(0, chunk_lo) // BLOCK_M) * BLOCK_M)
        last_key = tl.minimum(start_n + BLOCK_N, SEQ_K) - 1
        m_hi = tl.minimum(m_hi, (last_key // chunk + 1) * chunk - shift)
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
        chunk,
        doc_row,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_CHUNK,
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
        p = tl.exp2(z2 - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        dz = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            dz = dz * (1.0 - th * th)  # d/ds [c * tanh(s / c)]
        dq += tl.dot(dz.to(k.dtype), k, input_precision=DOT_PREC)
    dq_ptrs = DQ + (pid_bh * SEQ_Q + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
