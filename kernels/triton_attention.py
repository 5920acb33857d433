"""The ``yamlformer::flash_attention`` custom op: its forward and backward (composed of the launches
in :mod:`yamlformer.kernels.flash_launch`), autograd, fake/meta implementation and FLOP formulas.

The ``@triton.jit`` kernels live in :mod:`yamlformer.kernels.flash_forward`, ``flash_decode``,
``flash_backward_dq`` and ``flash_backward``, their shared helpers in ``flash_kernels`` (which also
sets up the Triton interpreter on machines without CUDA); their launch configs in
:mod:`yamlformer.kernels.tuning`. This module is imported lazily by
:func:`yamlformer.kernels.attention` the first time ``backend="triton"`` is used.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

# triton comes through flash_kernels (via flash_launch), which sets up the interpreter first
from . import flash_launch
from .flash_launch import INTERPRET
from .masks import Mask


def op_args(mask: Mask, scale: float, document_starts: torch.Tensor | None = None) -> tuple:
    """``mask`` as the custom op takes it after ``q, k, v``: flat, as ``torch.library`` requires of
    an op's schema (tensors, numbers, None), in :func:`flash_attention`'s order."""
    query_index, key_index = mask.token_index if mask.token_index is not None else (None, None)
    return (
        mask.bias,
        mask.alibi_slopes,
        bool(mask.causal),
        None if mask.sliding_window is None else int(mask.sliding_window),
        None if mask.softcap is None else float(mask.softcap),
        float(scale),
        document_starts,
        mask.sinks,
        mask.chunk_size,
        query_index,
        key_index,
    )


def _mask(bias, alibi_slopes, causal, sliding_window, softcap, sinks, chunk_size, query_index, key_index) -> Mask:
    """The :class:`Mask` the op's flat arguments spell (its documents are the op's ``document_starts``)."""
    token_index = (query_index, key_index) if query_index is not None else None
    return Mask(
        causal=causal,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
        bias=bias,
        softcap=softcap,
        token_index=token_index,
        sinks=sinks,
    )


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


def flash_forward(q, k, v, mask: Mask, scale: float, document_starts=None):
    """Returns ``(out, lse)``: ``out`` (B, H, Sq, Dv); ``lse`` the log2-domain log-sum-exp,
    (B, H, Sq) fp32, the sink included. ``document_starts``: (B, Sk) int,
    ``yamlformer.kernels.masks.document_starts`` of the mask's documents."""
    _check_device(q)
    out, lse = _forward_outputs(q, v)
    if out.numel() == 0 or k.shape[2] == 0:
        return out.zero_(), lse.fill_(float("inf"))
    call = flash_launch.prepare(q, k, v, mask, scale, document_starts)
    (flash_launch.decode if call.decodes else flash_launch.forward)(call, out, lse)
    return out, lse


def flash_backward(grad_out, q, k, v, out, lse, mask: Mask, scale: float, bias_needs_grad: bool, document_starts=None):
    """Returns ``(dq, dk, dv, dbias, dsinks)``; ``dbias`` is reduced to ``bias.shape`` when
    ``bias_needs_grad``, else an empty tensor; ``dsinks`` is (H,) with ``sinks``, else empty."""
    _check_device(q)
    bias, sinks = mask.bias, mask.sinks
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    # every tile of dq, dk, dv is stored by the kernels (dk/dv tiles with no visible query as 0)
    dq, dk, dv = _gradient_outputs(q, k, v)
    # dz of every score: the (B, H, Sq, Sk) matrix only exists when the bias itself needs a grad
    dbias_full = torch.zeros((B, H, Sq, Sk) if bias_needs_grad else (0,), dtype=torch.float32, device=q.device)
    dsinks = torch.zeros((H,) if sinks is not None else (0,), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or Sk == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
    else:
        call = flash_launch.prepare(q, k, v, mask, scale, document_starts)
        delta = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)  # rowsum(dO * O), by the dq kernel
        flash_launch.backward_dq(call, grad_out, out, lse, delta, dq)
        flash_launch.backward_dkdv(call, grad_out, lse, delta, dk, dv, dbias_full)
        if sinks is not None:  # d sink_h = -sum_{b, i} p_sink(b, h, i) * delta(b, h, i)
            p_sink = torch.exp2(sinks.float()[None, :, None] * 1.4426950408889634 - lse)  # 1/ln(2)
            dsinks = -(p_sink * delta).sum(dim=(0, 2))
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
    query_index: torch.Tensor | None = None,
    key_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention; returns ``(out (B, H, Sq, Dv), lse (B, H, Sq) fp32, log2 domain)``. The
    arguments after ``q, k, v`` are a :class:`Mask` flattened (:func:`op_args`)."""
    mask = _mask(bias, alibi_slopes, causal, sliding_window, softcap, sinks, chunk_size, query_index, key_index)
    return flash_forward(q, k, v, mask, scale, document_starts)


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
    query_index=None,
    key_index=None,
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
    query_index: torch.Tensor | None = None,
    key_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = _mask(bias, alibi_slopes, causal, sliding_window, softcap, sinks, chunk_size, query_index, key_index)
    return flash_backward(grad_out, q, k, v, out, lse, mask, scale, bias_needs_grad, document_starts)


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
    query_index=None,
    key_index=None,
):
    # as flash_backward returns them: dbias reduced to bias.shape and contiguous, dsinks (H,)
    dbias = bias.new_empty(bias.shape) if bias_needs_grad else q.new_empty((0,), dtype=torch.float32)
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return (*_gradient_outputs(q, k, v), dbias, dsinks)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, alibi_slopes, causal, sliding_window, softcap, scale, document_starts, sinks, chunk_size = inputs[
        :12
    ]
    query_index, key_index = inputs[12:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias, alibi_slopes, document_starts, sinks, query_index, key_index)
    ctx.knobs = (causal, sliding_window, softcap, scale)
    ctx.chunk_size = chunk_size


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, bias, alibi_slopes, document_starts, sinks, query_index, key_index = ctx.saved_tensors
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
        query_index,
        key_index,
    )
    dsinks = dsinks if sinks is not None and ctx.needs_input_grad[10] else None
    return (
        dq,
        dk,
        dv,
        (dbias if bias_needs_grad else None),
        None,
        None,
        None,
        None,
        None,
        None,
        dsinks,
        None,
        None,
        None,
    )


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
