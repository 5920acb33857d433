"""Host side of the Triton attention: autotuning, launches, and the ``yamlformer::flash_attention``
custom op (autograd, fake/meta implementation, FLOP formulas).

The ``@triton.jit`` kernels live in :mod:`yamlformer.kernels.flash_kernels`, which also sets up the Triton
interpreter on machines without CUDA. This module is imported lazily by
:func:`yamlformer.kernels.attention` the first time ``backend="triton"`` is used.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

# triton comes through flash_kernels, which sets up the interpreter before importing it
from .flash_backward import _attn_bwd_dkdv, _attn_bwd_dq
from .flash_decode import _attn_decode, _attn_decode_combine
from .flash_kernels import INTERPRET, _attn_fwd, triton

# Block sizes used without autotuning (interpreter). 32 keeps the interpreter fast enough while
# still exercising multi-tile loops and masked tails at test lengths (17..100).
INTERPRET_BLOCK_M = 32
INTERPRET_BLOCK_N = 32
# Decode path: taken when few query rows (all heads of a kv group packed together) meet a cache.
DECODE_MAX_SEQ_Q = 16
DECODE_MAX_ROWS = 64  # group_size * seq_q packed into one M tile


# ----------------------------------------------------------------------------------------------
# autotuning (CUDA only; the interpreter uses the fixed INTERPRET_BLOCK_* sizes)
# ----------------------------------------------------------------------------------------------
def _config(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


_FWD_CONFIGS = [
    _config(128, 64, 4, 3),
    _config(128, 64, 8, 3),
    _config(128, 128, 8, 2),
    _config(128, 32, 4, 4),
    _config(64, 64, 4, 3),
    _config(64, 32, 4, 4),
    _config(64, 64, 4, 2),
    _config(64, 32, 4, 2),
]
_DKDV_CONFIGS = [
    _config(32, 64, 4, 3),
    _config(64, 64, 4, 3),
    _config(32, 128, 8, 3),
    _config(64, 128, 8, 2),
    _config(16, 64, 4, 3),
    _config(32, 32, 4, 2),
]
_DQ_CONFIGS = [
    _config(64, 64, 4, 3),
    _config(128, 64, 8, 3),
    _config(64, 32, 4, 4),
    _config(128, 32, 4, 3),
    _config(128, 128, 8, 2),
    _config(32, 32, 4, 2),
]
_DECODE_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bn, w, s in ((32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 2))
]
_DECODE_MAX_BLOCK_N = 128  # the split length is a multiple of every decode BLOCK_N
_TUNE_KEY = [
    "SEQ_Q_BUCKET",
    "SEQ_K_BUCKET",
    "HEAD_DIM",
    "HEAD_DIM_V",
    "GROUP",
    "IS_CAUSAL",
    "HAS_WINDOW",
    "HAS_CHUNK",
    "HAS_DOCS",
]
_SMEM_BUDGET = 200 * 1024  # bytes; H100/H200 allow 227 KiB per block, leave headroom


def _pruner(resident, streamed):
    """Pruning function for one kernel. ``resident``/``streamed`` name the tile ("M" or "N")
    held for the whole program and the one pipelined ``num_stages`` deep, for the shared-memory
    estimate ``element bytes * (BLOCK_D * resident rows + stages * (BLOCK_D + BLOCK_DV) *
    streamed rows)`` (the streamed tile pairs a key-wide and a value-wide tensor). Query
    tiles far taller than the query length are dropped too; at least one config always survives
    (and the autotuner itself skips any config that still runs out of resources)."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        block_d, block_dv = args["BLOCK_D"], args["BLOCK_DV"]
        seq_q, elt = args["SEQ_Q"], args["Q"].element_size()
        kept = []
        for c in configs:
            rows = {"M": c.kwargs.get("BLOCK_M", args.get("BLOCK_M")), "N": c.kwargs["BLOCK_N"]}
            smem = elt * (block_d * rows[resident] + c.num_stages * (block_d + block_dv) * rows[streamed])
            too_tall = "BLOCK_M" in c.kwargs and rows["M"] > max(16, triton.next_power_of_2(seq_q))
            if smem <= _SMEM_BUDGET and not too_tall:
                kept.append(c)
        return kept or [min(configs, key=lambda c: c.num_stages * c.kwargs["BLOCK_N"] * c.kwargs.get("BLOCK_M", 1))]

    return prune


def _tuned(kernel, configs, resident, streamed):
    if INTERPRET:
        return kernel
    prune = {"early_config_prune": _pruner(resident, streamed)}
    return triton.autotune(configs=configs, key=_TUNE_KEY, prune_configs_by=prune)(kernel)


_fwd_kernel = _tuned(_attn_fwd, _FWD_CONFIGS, "M", "N")
_dkdv_kernel = _tuned(_attn_bwd_dkdv, _DKDV_CONFIGS, "N", "M")
_dq_kernel = _tuned(_attn_bwd_dq, _DQ_CONFIGS, "M", "N")
_decode_kernel = _tuned(_attn_decode, _DECODE_CONFIGS, "M", "N")


def _fixed_blocks(with_m=True):
    """Block sizes for untuned (interpreter) launches; autotuned kernels pick their own."""
    if not INTERPRET:
        return {}
    blocks = {"BLOCK_N": INTERPRET_BLOCK_N}
    if with_m:
        blocks["BLOCK_M"] = INTERPRET_BLOCK_M
    return blocks


# ----------------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------------
def _strides4(t):
    return tuple(t.stride())


def _common(q, k, v, bias, alibi_slopes, causal, sliding_window, softcap, document_starts, chunk_size=None):
    """Launch arguments shared by every kernel: the tensors the scores read (bias view, ALiBi
    slopes, document starts), their strides (bias, then the starts' row), flags, scalar knobs."""
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    if bias is not None:
        bias_arg = bias.expand(B, H, Sq, Sk)  # stride 0 on broadcast dims, no copy
        bias_strides = _strides4(bias_arg)
    else:
        bias_arg, bias_strides = q, (0, 0, 0, 0)  # never read: HAS_BIAS=False
    alibi_arg = alibi_slopes.contiguous() if alibi_slopes is not None else q
    if document_starts is not None:
        docs_arg = document_starts.to(torch.int32).contiguous()  # (B, Sk)
        doc_stride = docs_arg.stride(0)
    else:
        docs_arg, doc_stride = q, 0  # never read: HAS_DOCS=False
    flags = dict(
        IS_CAUSAL=bool(causal),
        HAS_WINDOW=sliding_window is not None,
        HAS_CHUNK=chunk_size is not None,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_DOCS=document_starts is not None,
        UPCAST=INTERPRET and q.dtype != torch.float32,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_DV=max(16, triton.next_power_of_2(v.shape[-1])),
    )
    knobs = (float(softcap or 0.0), int(sliding_window or 0), int(chunk_size or 1))
    return (bias_arg, alibi_arg, docs_arg), (*bias_strides, doc_stride), flags, knobs


def _forward_outputs(q, v):
    """``(out, lse)`` as the forward returns them: ``out`` (B, H, Sq, Dv) contiguous in ``q``'s
    dtype, ``lse`` (B, H, Sq) fp32. The kernels and the fake implementation both allocate here,
    so ``torch.compile`` sees the strides the kernels return."""
    B, H, Sq, _ = q.shape
    return q.new_empty((B, H, Sq, v.shape[3])), q.new_empty((B, H, Sq), dtype=torch.float32)


def _gradient_outputs(q, k, v):
    """``(dq, dk, dv)`` as the backward kernels store them: contiguous, whatever the inputs'
    layout (a query laid out (B, S, H, D) still gets a (B, H, S, D)-contiguous ``dq``)."""
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _check_device(q):
    if q.device.type == "cpu" and not INTERPRET:
        raise ValueError(
            "backend='triton' got CPU tensors but Triton is not in interpreter mode: set "
            "TRITON_INTERPRET=1 before `kernels` first uses Triton, or move the tensors to CUDA."
        )


def _decode_splits(batch_kv, seq_k, device):
    """(num_splits, split_len) for the FlashDecoding path: enough programs to fill the GPU."""
    block = INTERPRET_BLOCK_N if INTERPRET else _DECODE_MAX_BLOCK_N
    if INTERPRET:
        target = 4
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        target = max(1, triton.cdiv(2 * sms, batch_kv))
    split_len = max(block, triton.cdiv(triton.cdiv(seq_k, target), block) * block)
    return triton.cdiv(seq_k, split_len), split_len


def flash_forward(
    q,
    k,
    v,
    bias,
    alibi_slopes,
    causal,
    sliding_window,
    softcap,
    scale,
    document_starts=None,
    sinks=None,
    chunk_size=None,
):
    """Returns ``(out, lse)``: ``out`` (B, H, Sq, Dv); ``lse`` the log2-domain log-sum-exp,
    (B, H, Sq) fp32, the sink included. ``document_starts``: (B, Sk) int,
    ``yamlformer.kernels.attention.document_starts``; ``sinks``: (H,) raw logits; ``chunk_size``: int."""
    _check_device(q)
    B, H, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = H // Hkv
    out, lse = _forward_outputs(q, v)
    if out.numel() == 0 or Sk == 0:
        return out.zero_(), lse.fill_(float("inf"))
    reads, bs, flags, (cap, window, chunk) = _common(
        q, k, v, bias, alibi_slopes, causal, sliding_window, softcap, document_starts, chunk_size
    )
    sinks_arg = sinks.float().contiguous() if sinks is not None else lse  # never read without HAS_SINKS
    # next powers of two of the lengths: the autotuning key, so a growing cache does not retune
    tail = (
        *(H, group, Sq, Sk, D, Dv, scale, cap, window, chunk),
        *(triton.next_power_of_2(Sq), triton.next_power_of_2(Sk)),
    )
    if Sq <= DECODE_MAX_SEQ_Q and group * Sq <= DECODE_MAX_ROWS:
        num_splits, split_len = _decode_splits(B * Hkv, Sk, q.device)
        o_part = torch.empty((B * H * Sq, num_splits, Dv), dtype=torch.float32, device=q.device)
        l_part = torch.empty((B * H * Sq, num_splits), dtype=torch.float32, device=q.device)
        bias_arg, alibi_arg, docs_arg = reads
        _launch_decode(
            q,
            k,
            v,
            o_part,
            l_part,
            bias_arg,
            alibi_arg,
            bs,
            tail,
            (split_len, num_splits),
            flags,
            (num_splits, B * Hkv),
            max(16, triton.next_power_of_2(group * Sq)),
            docs_arg,
        )
        _attn_decode_combine[(B * H * Sq,)](
            o_part,
            l_part,
            out,
            lse,
            sinks_arg,
            *_strides4(out),
            H,
            Sq,
            Dv,
            num_splits,
            HAS_SINKS=sinks is not None,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_DV=flags["BLOCK_DV"],
        )
        return out, lse
    grid = lambda meta: (triton.cdiv(Sq, meta["BLOCK_M"]), B * H)
    _fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        *reads,
        sinks_arg,
        *_strides4(q),
        *_strides4(k),
        *_strides4(v),
        *_strides4(out),
        *bs,
        *tail,
        **flags,
        HAS_SINKS=sinks is not None,
        **_fixed_blocks(),
    )
    return out, lse


def _launch_decode(q, k, v, o_part, l_part, bias_arg, alibi_arg, bs, tail, split, flags, grid, block_m, docs_arg):
    _decode_kernel[grid](
        q,
        k,
        v,
        o_part,
        l_part,
        bias_arg,
        alibi_arg,
        docs_arg,
        *_strides4(q),
        *_strides4(k),
        *_strides4(v),
        *bs,
        *tail,
        *split,
        **flags,
        BLOCK_M=block_m,
        **_fixed_blocks(with_m=False),
    )


def flash_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    bias,
    alibi_slopes,
    causal,
    sliding_window,
    softcap,
    scale,
    bias_needs_grad,
    document_starts=None,
    sinks=None,
    chunk_size=None,
):
    """Returns ``(dq, dk, dv, dbias, dsinks)``; ``dbias`` is reduced to ``bias.shape`` when
    ``bias_needs_grad``, else an empty tensor; ``dsinks`` is (H,) with ``sinks``, else empty."""
    _check_device(q)
    B, H, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = H // Hkv
    # every tile of dq, dk, dv is stored by the kernels (dk/dv tiles with no visible query as 0)
    dq, dk, dv = _gradient_outputs(q, k, v)
    # dz of every score: the (B, H, Sq, Sk) matrix only exists when the bias itself needs a grad
    dbias_full = torch.zeros((B, H, Sq, Sk) if bias_needs_grad else (0,), dtype=torch.float32, device=q.device)
    dsinks = torch.zeros((H,) if sinks is not None else (0,), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or Sk == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
    else:
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, Sq) rowsum(dO * O)
        if sinks is not None:  # d sink_h = -sum_{b, i} p_sink(b, h, i) * delta(b, h, i)
            p_sink = torch.exp2(sinks.float()[None, :, None] * 1.4426950408889634 - lse)  # 1/ln(2)
            dsinks = -(p_sink * delta).sum(dim=(0, 2))
        reads, bs, flags, (cap, window, chunk) = _common(
            q, k, v, bias, alibi_slopes, causal, sliding_window, softcap, document_starts, chunk_size
        )
        tail = (
            *(H, group, Sq, Sk, D, Dv, scale, cap, window, chunk),
            *(triton.next_power_of_2(Sq), triton.next_power_of_2(Sk)),
        )
        strides = (*_strides4(q), *_strides4(k), *_strides4(v), *_strides4(grad_out), *bs)
        grid_kv = lambda meta: (triton.cdiv(Sk, meta["BLOCK_N"]), B * Hkv)
        _dkdv_kernel[grid_kv](
            q,
            k,
            v,
            grad_out,
            lse,
            delta,
            dk,
            dv,
            dbias_full,
            *reads,
            *strides,
            *tail,
            **flags,
            HAS_DBIAS=bias_needs_grad,
            **_fixed_blocks(),
        )
        grid_q = lambda meta: (triton.cdiv(Sq, meta["BLOCK_M"]), B * H)
        _dq_kernel[grid_q](q, k, v, grad_out, lse, delta, dq, *reads, *strides, *tail, **flags, **_fixed_blocks())
    dsinks = dsinks.to(sinks.dtype) if sinks is not None else dsinks
    if not bias_needs_grad:
        return dq, dk, dv, dbias_full, dsinks
    lead = bias.dim() - 4  # bias may have fewer leading dims than 4
    shape4 = (1,) * -lead + tuple(bias.shape)
    dims = [i for i in range(4) if shape4[i] == 1 and dbias_full.shape[i] != 1]
    dbias = dbias_full.sum(dim=dims, keepdim=True) if dims else dbias_full
    return dq, dk, dv, dbias.reshape(bias.shape).to(bias.dtype).contiguous(), dsinks


# ----------------------------------------------------------------------------------------------
# custom op: autograd, fake (meta) implementation, FLOP formulas
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("yamlformer::flash_attention", mutates_args=())
def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    scale: float,
    document_starts: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention; returns ``(out (B, H, Sq, Dv), lse (B, H, Sq) fp32, log2 domain)``."""
    return flash_forward(
        q, k, v, bias, alibi_slopes, causal, sliding_window, softcap, scale, document_starts, sinks, chunk_size
    )


@flash_attention.register_fake
def _flash_attention_fake(
    q,
    k,
    v,
    bias,
    alibi_slopes,
    causal,
    sliding_window,
    softcap,
    scale,
    document_starts=None,
    sinks=None,
    chunk_size=None,
):
    return _forward_outputs(q, v)


@torch.library.custom_op("yamlformer::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    scale: float,
    bias_needs_grad: bool,
    document_starts: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        bias,
        alibi_slopes,
        causal,
        sliding_window,
        softcap,
        scale,
        bias_needs_grad,
        document_starts,
        sinks,
        chunk_size,
    )


@flash_attention_backward.register_fake
def _flash_attention_backward_fake(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    bias,
    alibi_slopes,
    causal,
    sliding_window,
    softcap,
    scale,
    bias_needs_grad,
    document_starts=None,
    sinks=None,
    chunk_size=None,
):
    # as flash_backward returns them: dbias reduced to bias.shape and contiguous, dsinks (H,)
    dbias = bias.new_empty(bias.shape) if bias_needs_grad else q.new_empty((0,), dtype=torch.float32)
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return (*_gradient_outputs(q, k, v), dbias, dsinks)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, alibi_slopes, causal, sliding_window, softcap, scale, document_starts, sinks, chunk_size = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, alibi_slopes, document_starts, sinks)
    ctx.knobs = (causal, sliding_window, softcap, scale)
    ctx.chunk_size = chunk_size


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, bias, alibi_slopes, document_starts, sinks = ctx.saved_tensors
    bias_needs_grad = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias, dsinks = flash_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        bias,
        alibi_slopes,
        *ctx.knobs,
        bias_needs_grad,
        document_starts,
        sinks,
        ctx.chunk_size,
    )
    dsinks = dsinks if sinks is not None and ctx.needs_input_grad[10] else None
    return dq, dk, dv, (dbias if bias_needs_grad else None), None, None, None, None, None, None, dsinks, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)


def _matmul_flops(q_shape, k_shape, v_shape):
    """Two matmuls over the full (Sq, Sk), as the eager reference does: 2 * B * H * Sq * Sk * (D + Dv)."""
    B, H, Sq, D = q_shape
    Sk, Dv = k_shape[2], v_shape[3]
    return 2 * B * H * Sq * Sk * D + 2 * B * H * Sq * Sk * Dv


@register_flop_formula(torch.ops.yamlformer.flash_attention)
def _flash_attention_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs):
    return _matmul_flops(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.yamlformer.flash_attention_backward)
def _flash_attention_backward_flops(grad_out_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs):
    # eager's backward: two matmuls per forward matmul (dV, dP, dQ, dK); the kernel's recompute
    # of Q K^T is not counted, matching what FlopCounterMode reports for the eager backend
    return 2 * _matmul_flops(q_shape, k_shape, v_shape)
