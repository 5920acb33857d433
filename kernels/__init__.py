"""Attention kernels: ``from kernels import attention``.

``yamlformer.kernels.attention`` holds the public dispatch and the PyTorch paths (``eager``, ``sdpa``);
``yamlformer.kernels.triton_attention`` holds the FlashAttention-2 Triton kernels and the
``yamlformer::flash_attention`` custom op. Triton is imported only when ``backend="triton"`` (or
``"auto"`` on CUDA tensors) is first used, so importing this package stays cheap.

Triton interpreter: Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is
decorated (its own ``triton.language`` helpers at ``import triton``, our kernels when
``yamlformer.kernels.triton_attention`` is imported), not when a kernel runs. So on a machine without CUDA
this package sets ``TRITON_INTERPRET=1`` at import (``os.environ.setdefault``: an explicit user
value wins; set ``TRITON_INTERPRET=0`` to opt out), which lets ``backend="triton"`` run on CPU
tensors with no setup. If ``triton`` was imported before (``torch.utils.flop_counter`` does),
``yamlformer.kernels.triton_attention`` re-wraps triton's helpers for the interpreter on first use.
"""

__project__ = "yamlformer"  # checked by yamlformer.builder.packages: this name is ours

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .attention import attention

__all__ = ["attention"]
