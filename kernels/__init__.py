"""Attention kernels: ``from yamlformer.kernels import attention``.

``yamlformer.kernels.attention`` holds the public dispatch and the PyTorch paths (``eager``, ``sdpa``),
``yamlformer.kernels.masks`` the one value that says what a call masks (``Mask``);
``yamlformer.kernels.triton_attention`` holds the FlashAttention-2 Triton kernels and the
``yamlformer::flash_attention`` custom op. Triton is imported only when ``backend="triton"`` (or
``"auto"`` on CUDA tensors) is first used, so importing this package stays cheap.

Triton interpreter: importing this package leaves the environment alone. On a machine without
CUDA the Triton kernels run under Triton's interpreter: ``TRITON_INTERPRET=1`` is set while
Triton and our kernels are decorated and while a kernel runs on CPU tensors, and put back as it
was after (:func:`yamlformer.kernels.flash_kernels.interpreting`); a value the user set wins
(``TRITON_INTERPRET=0`` opts out). If ``triton`` was imported before (``torch.utils.flop_counter``
does), ``yamlformer.kernels.flash_kernels`` re-wraps triton's helpers for the interpreter.
"""

__project__ = "yamlformer"  # checked by yamlformer.builder.packages: this name is ours

from .attention import attention
from .masks import Mask

__all__ = ["Mask", "attention"]
