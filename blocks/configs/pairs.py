"""Counting the query-key pairs an attention kernel visits (causal, windowed, chunked masks) in
closed form, and the bytes a fused kernel saves for its backward: what every attention config's
FLOP and memory counts read (``yamlformer.blocks.configs.base.AttentionBlock``)."""

from __future__ import annotations


def kernel_saved_bytes(
    batch: int,
    n_heads: int,
    seq_q: int,
    seq_k: int,
    v_head_dim: int,
    act_bytes: int,
    fused: bool,
    masked: bool,
    softcap: bool = False,
    dropout: bool = False,
    sinks: bool = False,
) -> int:
    """Bytes ``yamlformer.kernels.attention`` itself keeps for backward, beyond q, k and v (which the
    attention block counts, as it knows their layout). ``fused`` (FlashAttention: Triton on
    CUDA): the output and an fp32 log-sum-exp per row. Eager: the fp32 softmax, a tanh output
    under ``softcap``, with ``dropout`` its mask and the dropped probabilities, else the
    probabilities cast to the compute dtype for P.V (the softmax output itself when that is
    fp32 and nothing ``masked`` them); ``masked``, the one-byte flag per row of the rows left
    without a visible key. With ``sinks`` the softmax spans one more column per row (the
    sink's), which keeps every row finite (no flags), and P.V reads a view of it: no masked copy
    in fp32."""
    if fused:
        return batch * n_heads * seq_q * (v_head_dim * act_bytes + 4)
    pairs, rows = batch * n_heads * seq_q * seq_k, batch * n_heads * seq_q
    total = pairs * 4 * (2 if softcap else 1) + (rows * 4 if sinks else rows if masked else 0)
    if dropout:
        return total + pairs * (1 + act_bytes)
    return total + (pairs * act_bytes if act_bytes != 4 or (masked and not sinks) else 0)


def visible_pairs(seq_q: int, seq_k: int, causal: bool, window: int | None, chunk: int | None = None) -> int:
    """How many (query, key) pairs the mask keeps; queries are the last seq_q positions.

    Query row i sits at position ``i + seq_k - seq_q``; ``causal`` keeps keys at or before it,
    a window ``w`` keeps keys fewer than ``w`` positions back, a ``chunk`` C the keys of its
    own chunk (``pos // C``). Closed form (O(1)).
    """
    if chunk is not None:
        return _chunked_pairs(seq_q, seq_k, causal, window, chunk)
    if not causal and window is None:
        return seq_q * seq_k
    first, last = seq_k - seq_q, seq_k - 1  # query positions
    if causal:
        # keys 0..pos, capped at w: min(pos + 1, w) for each query position pos >= 0
        lo, hi = max(first, 0) + 1, last + 1
        return _sum_min(lo, hi, window if window is not None else hi)
    # window, not causal: every later key plus the w - 1 before: seq_k - max(0, pos - w + 1)
    n = last - first + 1
    return n * seq_k - _sum_range(max(first - window + 1, 1), last - window + 1)


def _chunked_pairs(seq_q: int, seq_k: int, causal: bool, window: int | None, chunk: int) -> int:
    """:func:`visible_pairs` under chunks: the first and last chunks the queries meet counted
    alone, every chunk between them (whole, all its queries present) the same."""
    first, last = seq_k - seq_q, seq_k - 1  # query positions
    if seq_q <= 0:
        return 0
    lo_chunk, hi_chunk = first // chunk, last // chunk
    total = _chunk_pairs(first, min(last, lo_chunk * chunk + chunk - 1), lo_chunk * chunk, seq_k, causal, window, chunk)
    if hi_chunk > lo_chunk:
        start = hi_chunk * chunk
        total += _chunk_pairs(start, last, start, seq_k, causal, window, chunk)
    middle = hi_chunk - lo_chunk - 1
    if middle > 0:
        start = (lo_chunk + 1) * chunk
        total += middle * _chunk_pairs(start, start + chunk - 1, start, seq_k, causal, window, chunk)
    return total


def _chunk_pairs(lo: int, hi: int, begin: int, seq_k: int, causal: bool, window: int | None, chunk: int) -> int:
    """Visible pairs of the query positions ``lo..hi``, all in the chunk starting at ``begin``."""
    if causal:  # keys begin..pos, capped at w: min(pos - begin + 1, w)
        m_lo, m_hi = lo - begin + 1, hi - begin + 1
        return _sum_min(m_lo, m_hi, window if window is not None else m_hi)
    top = min(begin + chunk - 1, seq_k - 1)  # the chunk's last key
    n = hi - lo + 1
    if window is None:
        return n * (top - begin + 1)
    # keys max(begin, pos - w + 1)..top: the chunk's keys less max(0, pos - w + 1 - begin)
    return n * (top - begin + 1) - _sum_range(max(lo - window + 1 - begin, 1), hi - window + 1 - begin)


def _sum_range(lo: int, hi: int) -> int:
    """lo + (lo + 1) + ... + hi (0 when empty)."""
    return (lo + hi) * (hi - lo + 1) // 2 if hi >= lo else 0


def _sum_min(lo: int, hi: int, cap: int) -> int:
    """sum of min(m, cap) for m in lo..hi."""
    if hi < lo:
        return 0
    return _sum_range(lo, min(hi, cap)) + cap * max(0, hi - max(lo, cap + 1) + 1)


# -- positions ---------------------------------------------------------------------------------
