"""Public attention entry point: argument checks, backend dispatch and the PyTorch paths.

Backends:

* ``eager``: two explicit matmuls (``Q K^T`` and ``P V``) over the full ``(seq_q, seq_k)``
  whatever the mask, fp32 softmax. The FLOP-counting reference (``4 * B * H * Sq * Sk * D``).
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with an additive float mask for
  windows, chunks, ALiBi and bias; falls back to ``eager`` for soft-capping, which SDPA cannot do.
  SDPA has no sink argument: the sinks become one more key (a zero key and a zero value, so its
  score is 0 and it adds nothing to the output) whose additive mask column is ``sinks[h]``. That
  keeps SDPA's fused kernels (and their gradient of the mask, which is the sinks' gradient), at
  the cost of an ``(batch | 1, n_heads, seq_q, seq_k + 1)`` mask in ``q``'s dtype (so a bf16
  model's sink logits are rounded to bf16 there) and a copy of the keys and values one longer.
* ``triton``: the FlashAttention-2 kernels in :mod:`yamlformer.kernels.triton_attention` (imported on first
  use; on CPU tensors they run under the Triton interpreter). Sinks and chunks are inside the
  kernels: the online softmax starts from the sink logit, chunks skip whole key tiles.
* ``auto`` (:func:`auto_backend`): on CUDA, first what the tuning table measured for this case on
  this GPU generation (``yamlformer.kernels.tuning``'s ``prefer``, written by
  ``benchmarks/attention.py --sweep --write-table``; :func:`measured_backend`); else ``sdpa``
  wherever SDPA runs the attention without a mask tensor (no mask, or causal over equal lengths:
  its flash and cuDNN kernels, which measured faster than ours on an H200,
  ``benchmarks/RESULTS.md``), and ``triton`` where only a mask tensor would express it to SDPA
  (windows, chunks, documents, ALiBi, a bias, sinks, explicit token indices) or SDPA cannot at
  all (soft-capping); ``sdpa`` on every other device, and whenever ``dropout_p > 0`` or a head dim
  is over 256, which the Triton kernels do not handle.

The values may be narrower or wider than the queries and keys (``v`` ``(..., head_dim_v)``, the
output ``(..., head_dim_v)``): DeepSeek's multi-head latent attention scores with 192-wide heads
and mixes 128-wide values. Every backend takes it (SDPA's math and memory-efficient kernels do).

Mask semantics, shared by every backend: query row ``i`` sits at position ``i + seq_k - seq_q``
(the queries are the last ``seq_q`` positions), key ``j`` at position ``j``; with ``d`` the
query position minus the key position, ``causal`` keeps ``d >= 0``, ``sliding_window=w`` keeps
``d < w``, ``chunk_size=C`` keeps the keys of the query's chunk (``pos_q // C == pos_k // C``,
Llama 4's chunked local attention), and ALiBi adds ``-slope_h * d``. Scores are ``q.k * scale``, then
``softcap * tanh(. / softcap)``, then ``+ bias + alibi``, then the masks. A query row with no
visible key returns 0 (not NaN) and passes no gradient.

``sinks`` ``(n_heads,)`` (GPT-OSS's attention sinks): a learned logit per head that joins every
row's softmax as one more column and is dropped after it, ``p_ij = exp(s_ij) / (exp(sink_h) +
sum_j exp(s_ij))``: a row's weights sum to less than 1, and a row with no visible key puts all
its weight on the sink (output 0). The sink is a raw logit: no ``scale``, soft-cap or mask
touches it. Its gradient is ``-sum_i p_sink(i) * rowsum(dO_i * O_i)``.

``token_index=(query_index, key_index)`` replaces that layout with explicit token indices, for
keys held out of order (a static decoding cache: every slot of a preallocated buffer, a ring
buffer's slots after it wraps): ``d`` is ``query_index[i] - key_index[j]`` and a key whose index
is negative (an empty slot) is never visible. The same masks and ALiBi distances follow. The
Triton kernels read the indices; the other backends get them as one additive mask.

The options arrive as one frozen :class:`~yamlformer.kernels.masks.Mask` (``attention(q, k, v,
Mask(causal=True, sliding_window=4096))``); what each means:

``document_ids`` ``(batch, seq_k)`` (several documents packed in one row): the document of each
key, the queries being the last ``seq_q`` keys as above; a query sees only the keys of its own
document, on top of the other masks. A document is a run of equal ids along the row (the ids
are non-decreasing, ``[0, 0, 0, 1, 1, 2]``); every backend masks by :func:`document_starts`,
the token index where each token's run begins, since two tokens share a document exactly when
they share a start. A query always sees itself, so no row is left without a key by documents.
Without ``document_ids`` every path runs exactly as before.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from .masks import Mask, document_starts

__all__ = [
    "BACKENDS",
    "MAX_TRITON_HEAD_DIM",
    "Mask",
    "attention",
    "auto_backend",
    "document_starts",
    "measured_backend",
]

BACKENDS = ("auto", "eager", "sdpa", "triton")
MAX_TRITON_HEAD_DIM = 256


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | None = None,
    *,
    scale: float | None = None,
    backend: str = "auto",
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Multi-head attention with GQA/MQA, causal, sliding-window, chunk and document masks, ALiBi,
    an additive bias, score soft-capping and attention sinks.

    Args:
        q: ``(batch, n_heads, seq_q, head_dim)``.
        k: ``(batch, n_kv_heads, seq_k, head_dim)``; ``n_heads`` a multiple of ``n_kv_heads``.
        v: ``(batch, n_kv_heads, seq_k, head_dim_v)``; ``head_dim_v`` may differ from ``head_dim``.
        mask: what is masked and added to the scores (:class:`~yamlformer.kernels.masks.Mask`,
            the module doc); None: nothing, every query sees every key.
        scale: score scale, default ``1 / sqrt(head_dim)``.
        backend: ``auto`` | ``eager`` | ``sdpa`` | ``triton``.
        dropout_p: attention dropout probability (``eager``/``sdpa`` only).

    Returns:
        ``(batch, n_heads, seq_q, head_dim_v)`` in ``q``'s dtype.
    """
    mask = Mask() if mask is None else mask
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a yamlformer.kernels.Mask (Mask(causal=True, sliding_window=...)), got {type(mask).__name__}"
        )
    _check(q, k, v, mask, backend, dropout_p)
    _check_sinks_chunks(q, mask.sinks, mask.chunk_size)
    if mask.chunk_size is not None:
        mask = mask.replace(chunk_size=int(mask.chunk_size))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    starts = document_starts(mask.document_ids) if mask.document_ids is not None else None
    if backend == "auto":
        backend = auto_backend(q.device.type, q, v, mask, dropout_p)
    if mask.token_index is not None and backend != "triton":
        # Explicit indices: the masks and ALiBi become one additive bias (the Triton kernels read
        # the indices themselves).
        bias = _additive(q, k, mask, torch.float32)
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))  # (batch | 1, heads | 1, Sq, Sk)
        mask = Mask(bias=bias, softcap=mask.softcap, sinks=mask.sinks)  # (documents never come with indices)
        if backend == "sdpa" and mask.softcap is None:
            return _masked_sdpa(q, k, v, bias.to(q.dtype), scale, dropout_p, mask.sinks)
    if backend == "triton":
        if dropout_p > 0.0:
            raise ValueError(
                f"backend='triton' does not implement attention dropout (got "
                f"dropout_p={dropout_p}); use backend='sdpa' or 'eager' to train "
                f"with dropout"
            )
        if max(q.shape[-1], v.shape[-1]) > MAX_TRITON_HEAD_DIM:
            raise ValueError(
                f"backend='triton' supports head_dim <= {MAX_TRITON_HEAD_DIM}, got "
                f"{q.shape[-1]} (values {v.shape[-1]}); use backend='sdpa' or 'eager'"
            )
        try:
            from . import triton_attention  # lazy: importing triton costs ~1 s
        except ImportError as exc:
            raise ImportError(
                f"backend='triton' needs the `triton` package ({exc}); use backend='sdpa' or 'eager' without it"
            ) from exc

        out, _ = triton_attention.flash_attention(q, k, v, *triton_attention.op_args(mask, scale, starts))
        return out
    if backend == "sdpa" and mask.softcap is None:
        return _sdpa(q, k, v, mask, scale, dropout_p, starts)
    return _eager(q, k, v, mask, scale, dropout_p, starts)


def auto_backend(device_type: str, q: torch.Tensor, v: torch.Tensor, mask: Mask, dropout_p: float) -> str:
    """The backend ``backend="auto"`` runs on a ``device_type`` device (the module doc) for ``mask``."""
    if device_type != "cuda" or dropout_p > 0.0 or max(q.shape[-1], v.shape[-1]) > MAX_TRITON_HEAD_DIM:
        return "sdpa"
    present = mask.present()
    measured = measured_backend(device_type, q, v.shape[-1], mask.causal, present)
    if measured is not None:
        return measured
    if not any(present.values()) and _sdpa_unmasked(mask.causal, q.shape[2], v.shape[2]):
        return "sdpa"
    return "triton"


def measured_backend(device_type: str, q: torch.Tensor, v_head_dim: int, causal: bool, present: dict) -> str | None:
    """The backend the tuning table's ``prefer`` names for this case on the GPU generation of ``q``'s
    device (``yamlformer.kernels.tuning``: what ``benchmarks/attention.py --sweep`` measured
    faster), or None when it names none. Never ``sdpa`` for soft-capping, which SDPA cannot do."""
    if device_type != "cuda":
        return None
    from . import tuning  # no Triton import: the table is YAML

    case = tuning.case_key(q.shape, v_head_dim, causal, present)
    choice = tuning.preference_on(-1 if q.device.index is None else q.device.index, case)
    if choice not in ("sdpa", "triton") or (choice == "sdpa" and present["softcap"]):
        return None
    return choice


def _sdpa_unmasked(causal: bool, seq_q: int, seq_k: int) -> bool:
    """Whether SDPA runs causal (or not) attention of these lengths without a mask tensor: SDPA's
    ``is_causal`` aligns the queries at the top left, ours at the bottom right (the queries are
    the last ``seq_q`` positions), which agree when the lengths are equal; one query sees every key."""
    return not causal or seq_q == seq_k or seq_q == 1


def _check(q, k, v, mask: Mask, backend, dropout_p):
    sliding_window, alibi_slopes, bias, softcap = mask.sliding_window, mask.alibi_slopes, mask.bias, mask.softcap
    token_index, document_ids = mask.token_index, mask.document_ids
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if token_index is not None:
        if (
            not isinstance(token_index, tuple)
            or len(token_index) != 2
            or tuple(token_index[0].shape) != (q.shape[2],)
            or tuple(token_index[1].shape) != (k.shape[2],)
        ):
            raise ValueError(f"token_index must be (query_index ({q.shape[2]},), key_index ({k.shape[2]},)) tensors")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on batch, heads and length, got {tuple(k.shape)} and {tuple(v.shape)}")
    (B, H, _, D), (Bk, Hkv, _, Dk) = q.shape, k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"n_heads ({H}) must be a multiple of n_kv_heads ({Hkv})")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be a positive float or None, got {softcap}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    for name, t in (("alibi_slopes", alibi_slopes), ("bias", bias)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if alibi_slopes is not None and (tuple(alibi_slopes.shape) != (H,) or not alibi_slopes.dtype.is_floating_point):
        raise ValueError(
            f"alibi_slopes must be a float tensor of shape (n_heads,) = ({H},), "
            f"got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)}"
        )
    if bias is not None:
        if not bias.dtype.is_floating_point:
            raise ValueError(
                f"bias must be a floating additive bias, got {bias.dtype}; for a "
                f"boolean keep-mask pass torch.where(mask, 0.0, float('-inf'))"
            )
        target = (B, H, q.shape[2], k.shape[2])
        try:
            ok = bias.dim() <= 4 and torch.broadcast_shapes(bias.shape, target) == target
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"bias of shape {tuple(bias.shape)} does not broadcast to (batch, n_heads, seq_q, seq_k) = {target}"
            )
    if document_ids is not None:
        expected = (q.shape[0], k.shape[2])
        if not isinstance(document_ids, torch.Tensor) or tuple(document_ids.shape) != expected:
            got = tuple(document_ids.shape) if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__
            raise ValueError(f"document_ids must be a (batch, seq_k) = {expected} tensor, got {got}")
        if document_ids.dtype == torch.bool or document_ids.is_floating_point() or document_ids.is_complex():
            raise ValueError(f"document_ids must be an integer tensor, got {document_ids.dtype}")
        if document_ids.device != q.device:
            raise ValueError(f"document_ids is on {document_ids.device} but q is on {q.device}")
        if token_index is not None:
            raise ValueError(
                "document_ids cannot be combined with token_index (a static decoding cache's "
                "slots); pass the keys in token order"
            )


def _check_sinks_chunks(q, sinks, chunk_size):
    if chunk_size is not None:
        try:
            whole = not isinstance(chunk_size, bool) and operator.index(chunk_size) >= 1
        except TypeError:
            whole = False
        if not whole:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if sinks is None:
        return
    H = q.shape[1]
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (H,) or not sinks.dtype.is_floating_point:
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a float tensor of shape (n_heads,) = ({H},), got {got}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")


def _visible(seq_q: int, seq_k: int, mask: Mask, device, starts=None):
    """Boolean ``(seq_q, seq_k)`` keep-mask (``(batch, 1, seq_q, seq_k)`` with document
    ``starts``, :func:`document_starts` of the mask's documents; None when everything is visible)
    and the ``(seq_q, seq_k)`` distance ``pos_q - pos_k`` under ``mask``'s causal, window, chunks
    and token indices (the module doc)."""
    causal, sliding_window, chunk_size, token_index = (
        mask.causal,
        mask.sliding_window,
        mask.chunk_size,
        mask.token_index,
    )
    keep = None
    if token_index is not None:
        pos_q, pos_k = token_index
        keep = (pos_k >= 0)[None, :].expand(seq_q, seq_k)  # empty slots are never visible
    else:
        pos_q = torch.arange(seq_q, device=device) + (seq_k - seq_q)  # queries are the last seq_q
        pos_k = torch.arange(seq_k, device=device)
    dist = pos_q[:, None] - pos_k[None, :]  # (seq_q, seq_k)
    if causal:
        keep = dist >= 0 if keep is None else keep & (dist >= 0)
    if sliding_window is not None:
        in_window = dist < sliding_window
        keep = in_window if keep is None else keep & in_window
    if chunk_size is not None:
        same_chunk = (pos_q // chunk_size)[:, None] == (pos_k // chunk_size)[None, :]  # (seq_q, seq_k)
        keep = same_chunk if keep is None else keep & same_chunk
    if starts is not None:
        same = (starts[:, -seq_q:, None] == starts[:, None, :])[:, None]  # (batch, 1, seq_q, seq_k)
        keep = same if keep is None else keep & same
    return keep, dist


def _additive(q, k, mask: Mask, dtype, starts=None):
    """``mask``'s bias + ALiBi + masks as one additive ``dtype`` tensor broadcastable to
    (B, H, Sq, Sk), or None when there is nothing to add."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    keep, dist = _visible(seq_q, seq_k, mask, q.device, starts)
    bias, alibi_slopes = mask.bias, mask.alibi_slopes
    add = None
    if bias is not None:
        add = bias.to(dtype)
    if alibi_slopes is not None:
        alibi = -alibi_slopes.to(dtype)[:, None, None] * dist.to(dtype)  # (H, Sq, Sk)
        add = alibi if add is None else add + alibi
    if keep is not None:
        if add is None:
            add = torch.zeros((seq_q, seq_k), dtype=dtype, device=q.device)
        add = torch.where(keep, add, float("-inf"))
    return add


def _dead_rows(add: torch.Tensor) -> torch.Tensor:
    """Rows of the additive mask whose every entry is -inf: (..., Sq, 1) boolean."""
    return torch.isneginf(add).all(dim=-1, keepdim=True)


def _eager(q, k, v, mask: Mask, scale, dropout_p, starts=None):
    softcap, sinks = mask.softcap, mask.sinks
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)  # (batch, n_heads, seq_k, head_dim)
        v = v.repeat_interleave(group, dim=1)  # (batch, n_heads, seq_k, head_dim)
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale  # (batch, n_heads, Sq, Sk)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    add = _additive(q, k, mask, torch.float32, starts)
    dead = None
    if add is not None:
        scores = scores + add
    if sinks is not None:
        # the sink column keeps every row finite: a row with no visible key weighs only the sink
        column = sinks.float()[:, None, None].expand(*scores.shape[:-1], 1)  # (batch, n_heads, Sq, 1)
        p = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    else:
        if add is not None:
            dead = _dead_rows(scores)
            scores = torch.where(dead, 0.0, scores)  # keeps softmax (and its grad) finite
        p = torch.softmax(scores, dim=-1)
    if dead is not None:
        p = torch.where(dead, 0.0, p)
    if dropout_p > 0.0:
        p = F.dropout(p, p=dropout_p, training=True)
    return torch.matmul(p.to(v.dtype), v)  # (batch, n_heads, Sq, head_dim_v)


def _sdpa(q, k, v, mask: Mask, scale, dropout_p, starts=None):
    causal, sliding_window, chunk_size = mask.causal, mask.sliding_window, mask.chunk_size
    alibi_slopes, bias, sinks = mask.alibi_slopes, mask.bias, mask.sinks
    seq_q, seq_k = q.shape[2], k.shape[2]
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if starts is not None and alibi_slopes is None and bias is None and sinks is None:
        # documents (and causal, window, chunks) alone: a boolean mask, no float one; every query
        # sees itself, so no row is empty (SDPA would return NaN for one)
        keep, _ = _visible(seq_q, seq_k, mask, q.device, starts)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=scale, **gqa)
    plain = sliding_window is None and chunk_size is None and alibi_slopes is None and bias is None and sinks is None
    if plain and causal and _sdpa_unmasked(causal, seq_q, seq_k):
        is_causal = seq_q == seq_k and seq_q > 1  # one query sees every key: no mask at all
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **gqa)
    add = _additive(q, k, mask, q.dtype, starts)
    if add is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, **gqa)
    return _masked_sdpa(q, k, v, add, scale, dropout_p, sinks)


def _masked_sdpa(q, k, v, add, scale, dropout_p, sinks=None):
    """SDPA under an additive mask ``add`` (None: none), rows with no visible key returning 0;
    ``sinks`` as one more key: a zero key and value under a mask column of ``sinks[h]``."""
    if sinks is not None:
        q_rows = q.shape[:3]  # (batch, n_heads, Sq)
        k = torch.cat((k, k.new_zeros(*k.shape[:2], 1, k.shape[3])), dim=2)  # (batch, n_kv_heads, Sk + 1, head_dim)
        v = torch.cat((v, v.new_zeros(*v.shape[:2], 1, v.shape[3])), dim=2)  # (batch, n_kv_heads, Sk + 1, head_dim_v)
        if add is None:
            add = q.new_zeros(q_rows[2], k.shape[2] - 1)
        add = add.reshape((1,) * (4 - add.dim()) + tuple(add.shape))  # (batch | 1, heads | 1, Sq | 1, Sk)
        rows = (add.shape[0], q_rows[1], q_rows[2])  # (batch | 1, n_heads, Sq)
        column = sinks.to(q.dtype)[:, None, None].expand(*rows, 1)
        add = torch.cat((add.expand(*rows, add.shape[3]), column), dim=-1)  # (batch | 1, n_heads, Sq, Sk + 1)
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    dead = _dead_rows(add)
    add = torch.where(dead, 0.0, add)  # SDPA would return NaN on rows with no visible key
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=add, dropout_p=dropout_p, scale=scale, **gqa)
    return torch.where(dead, 0.0, out)
