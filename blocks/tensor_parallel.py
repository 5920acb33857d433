"""What a block uses under tensor parallelism beyond its plan: a weight every rank keeps whole
(differential attention's lambdas, attention sinks, QK-norm weights) reads the same on every rank,
and its gradient is the sum of the ranks' parts."""

from __future__ import annotations

import torch


class _SumGradient(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over a process group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def shared(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` (a replicated weight) as a rank reads it: itself, its gradient summed over ``group``
    (``None``: no tensor parallelism, ``t`` as it is)."""
    return t if group is None else _SumGradient.apply(t, group)
