"""The split-K decode kernel (FlashDecoding): a few query rows against a long KV cache, the keys
split over programs and the partial results combined in the same launch. Conventions, the
interpreter set-up and the shared helpers are :mod:`yamlformer.kernels.flash_kernels`'."""

from __future__ import annotations

from .flash_forward import _fwd_tiles
from .flash_kernels import LOG2E, _key_ranges, _query_rows, tl, triton


@triton.jit
def _attn_decode(
    Q,
    K,
    V,
    Out,
    Lse,
    OPart,
    LPart,
    Counter,
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
    SPLIT_LEN,
    NUM_SPLITS,
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
    """One program: one split of the keys (``SPLIT_LEN`` of them, a whole number of tiles) for
    all GROUP * SEQ_Q query rows of one kv head, so the cache is read once per kv head, not once
    per query head. Each program leaves its rows' partial output and log-sum-exp in ``OPart`` /
    ``LPart`` ((B * H * SEQ_Q, NUM_SPLITS, ...), fp32) and takes a ticket from ``Counter[b, h_kv]``
    (zeroed by the caller); the program that draws the last ticket combines the splits into
    ``Out`` and ``Lse``, the sink (once, there) joining the denominator."""
    split = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    h_kv_count = H // GROUP
    b = pid // h_kv_count
    h_kv = pid % h_kv_count
    r = tl.arange(0, BLOCK_M)
    row_ok = r < GROUP * SEQ_Q
    rr = tl.minimum(r, GROUP * SEQ_Q - 1)  # padding rows repeat the last real one: reads in bounds
    h = h_kv * GROUP + rr // SEQ_Q  # (BLOCK_M,) query head of each packed row
    i = rr % SEQ_Q  # (BLOCK_M,) query index of each packed row
    shift = SEQ_K - SEQ_Q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V

    q_ptrs = Q + b * stride_qb + h[:, None] * stride_qh + i[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + b * stride_kb + h_kv * stride_kh + offs_d * stride_kd
        v_src = V + b * stride_vb + h_kv * stride_vh + offs_dv * stride_vd
    qpos, slope, bias_rows, qdoc = _query_rows(
        i,
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
    end_row = DocEnds + b * stride_db

    lo, ilo, ihi, hi = _key_ranges(
        shift + split * 0,
        SEQ_K - 1 + split * 0,
        SEQ_K,
        window,
        chunk,
        doc_row,
        end_row,
        IS_CAUSAL,
        HAS_WINDOW,
        HAS_CHUNK,
        HAS_DOCS,
        HAS_INDEX,
        BLOCK_N,
    )
    first = split * SPLIT_LEN  # this split's keys [first, last), both on tile boundaries
    last = first + SPLIT_LEN
    lo = tl.maximum(lo, first)
    hi = tl.minimum(hi, last)
    ilo = tl.minimum(tl.maximum(ilo, lo), last)
    ihi = tl.minimum(tl.maximum(ihi, ilo), last)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
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
    dead = l_i == 0.0  # nothing visible in this split: weight 0 in the combine
    row = (b * H + h) * SEQ_Q + i  # (BLOCK_M,) row of the (B*H*SEQ_Q, NUM_SPLITS, ...) buffers
    part = row * NUM_SPLITS
    o_ptrs = OPart + (part + split)[:, None] * HEAD_DIM_V + offs_dv[None, :]
    tl.store(o_ptrs, acc / tl.where(dead, 1.0, l_i)[:, None], mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(LPart + part + split, tl.where(dead, float("-inf"), m_i + tl.log2(tl.where(dead, 1.0, l_i))), mask=row_ok)

    # the last program of this kv head to finish combines: its ticket orders every split's stores
    # (each program's threads reach the barrier after their stores; the release/acquire atomic
    # publishes them to the whole GPU) before its own reads, which skip the L1 (".cg")
    tl.debug_barrier()
    ticket = tl.atomic_add(Counter + pid, 1, sem="acq_rel", scope="gpu")
    if ticket == NUM_SPLITS - 1:
        tl.debug_barrier()
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINKS:  # as the forward: the sink's log2 logit starts the running max, weight 1
            m = tl.load(Sinks + h).to(tl.float32) * LOG2E
            total += 1.0
        out = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        for s in range(0, NUM_SPLITS):
            lse_s = tl.load(LPart + part + s, cache_modifier=".cg")
            o_s = tl.load(
                OPart + (part + s)[:, None] * HEAD_DIM_V + offs_dv[None, :],
                mask=dv_ok[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m, lse_s)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            w = tl.exp2(lse_s - m_use)
            out = out * alpha[:, None] + w[:, None] * o_s
            total = total * alpha + w
            m = m_new
        dead = total == 0.0
        out = out / tl.where(dead, 1.0, total)[:, None]
        lse = tl.where(dead, float("inf"), m + tl.log2(tl.where(dead, 1.0, total)))
        out_ptrs = Out + b * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_om + offs_dv[None, :] * stride_od
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(Lse + row, lse, mask=row_ok)
