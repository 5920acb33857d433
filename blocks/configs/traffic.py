"""What a block's memory-bound work moves over HBM (torch-free): :class:`Traffic`, and the counts
the built-in blocks share.

A training step's work is of two kinds. Matrix products and attention kernels are compute
(``flops``, ``kernel_flops``); everything else a block runs -- norms, activations, the gating
product, rotary embeddings, residual adds, dropout, layout copies, the loss's softmax -- reads and
writes HBM and does little arithmetic, so its time is its bytes over the GPU's bandwidth
(``yamlformer.builder.analysis.perf``). Each block counts its own bytes (``traffic``) the way its
module runs, per token:

* **eager**: one kernel per PyTorch op, each reading its inputs and writing its output whole
  (``x.float()`` reads 2 bytes and writes 4 per element in bf16); a reduction over the last
  dimension reads its input and writes a per-token value (counted 0);
* **fused** (torch.compile): each chain of such ops becomes one kernel, reading the chain's
  inputs once and writing its outputs once; layout copies stay copies.

Backward is counted op by op as autograd runs it (each op's gradient reads what it saved and the
incoming gradient and writes the outgoing one; two gradients meeting at a tensor are added), and
fused the same way. Bytes are per token; the caller multiplies by the tokens of a step.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Traffic:
    """HBM bytes per token of one block's memory-bound work: ``forward`` and ``backward`` eagerly,
    ``fused_forward`` and ``fused_backward`` under torch.compile (the module doc)."""

    forward: float = 0.0
    backward: float = 0.0
    fused_forward: float = 0.0
    fused_backward: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __mul__(self, factor: float) -> Traffic:
        return Traffic(*(a * factor for a in dataclasses.astuple(self)))

    __rmul__ = __mul__

    def passes(self, compiled: bool) -> tuple[float, float]:
        """``(forward, backward)`` bytes per token, eager or compiled."""
        return (self.fused_forward, self.fused_backward) if compiled else (self.forward, self.backward)


def same(forward: float, backward: float) -> Traffic:
    """Work torch.compile leaves as it is (a copy, a kernel of its own): the same bytes both ways."""
    return Traffic(forward, backward, forward, backward)


def to_fp32(act_bytes: int) -> int:
    """Bytes per element of ``x.float()`` (read ``act_bytes``, write 4); 0 when ``x`` is fp32 already."""
    return 0 if act_bytes == 4 else act_bytes + 4


def rms_norm(width: int, act_bytes: int) -> Traffic:
    """``yamlformer.blocks.norms.RMSNorm`` over ``width`` per token. Forward: ``x.float()``,
    ``pow(2)`` (read 4, write 4), ``mean`` (read 4), ``x * rsqrt(...)`` (8), ``* weight`` (8), ``.to``
    (read 4, write ``act_bytes``). Backward: the cast back (``act_bytes`` + 4), the weight's product
    (8) and its gradient (the product with the normalised input, 12, summed over tokens, 4), the
    ``rsqrt`` product (8) and its gradient's sum (12 + 4), ``mean``'s expansion (4), ``pow``'s (12),
    the two gradients of ``x`` added (12), the cast back (4 + ``act_bytes``). Fused: read the input,
    write the output; backward reads the input and the gradient and writes the input's gradient,
    then reads both again for the weight's."""
    cast = to_fp32(act_bytes)
    forward = cast + 8 + 4 + 8 + 8 + cast
    backward = cast + 8 + 16 + 8 + 16 + 4 + 12 + 12 + cast
    return Traffic(forward, backward, 2 * act_bytes, 5 * act_bytes) * width


def layer_norm(width: int, act_bytes: int) -> Traffic:
    """``yamlformer.blocks.norms.LayerNorm``: ``x.float()``, one ``F.layer_norm`` kernel (read 4,
    write 4), the cast back; backward: the casts, one ``layer_norm_backward`` kernel (reads the
    input and the gradient, writes the input's gradient: 12) and the weight's and bias's (reads
    both again: 8). Fused as :func:`rms_norm`."""
    cast = to_fp32(act_bytes)
    return Traffic(2 * cast + 8, 2 * cast + 20, 2 * act_bytes, 5 * act_bytes) * width


def activation(width: int, act_bytes: int, gated: bool) -> Traffic:
    """An FFN's elementwise work over its hidden ``width`` per token. The activation: read, write;
    its gradient reads the input and the incoming gradient and writes one. Gated (GLU), also the
    product with the up projection (read two, write one) and its two gradients (each reads two,
    writes one). Fused: a gated unit reads gate and up and writes the product (backward: reads
    the gradient, gate and up, writes two); an ungated activation stays one kernel either way."""
    a = act_bytes
    if not gated:
        return same(2 * a, 3 * a) * width
    return Traffic(5 * a, 9 * a, 3 * a, 5 * a) * width


def rotary(width: int, act_bytes: int) -> Traffic:
    """``yamlformer.blocks.positions.Rope`` rotating ``width`` elements per token (queries and keys
    together). Forward: ``rot * cos`` (2 x ``act_bytes``), ``rotate_half``'s negation of half and its
    concatenation (1 + 2), ``* sin`` (2), the sum (3), the concatenation with the unrotated rest (2):
    12 x ``act_bytes``; backward the same ops' gradients (the two products 2 + 2, the negation 1,
    the halves scattered back 4, the two gradients added 3): 12. Fused: read, write (each way)."""
    a = act_bytes
    return Traffic(12 * a, 12 * a, 2 * a, 2 * a) * width


def residual(width: int, act_bytes: int) -> Traffic:
    """One residual add over ``width`` per token: read two, write one; backward adds the gradient
    coming round the sub-layer to the one passing by (read two, write one). Fused into the norm
    that follows: the add's output written once, the gradients' sum written once."""
    a = act_bytes
    return Traffic(3 * a, 3 * a, a, a) * width


def dropout(width: int, act_bytes: int) -> Traffic:
    """Dropout over ``width`` per token: read, write and a one-byte mask; backward reads the
    gradient and the mask and writes one. Fused the same (the mask is kept either way)."""
    a = act_bytes
    return same(2 * a + 1, 2 * a + 1) * width


def layout_copy(width: int, act_bytes: int) -> Traffic:
    """A tensor of ``width`` per token copied into another layout (heads back to tokens before
    the output projection), and its gradient copied back."""
    return same(2 * act_bytes, 2 * act_bytes) * width


def routing(d_model: int, act_bytes: int, n_experts: int, top_k: int) -> Traffic:
    """A mixture of experts' dispatch per token (its experts' own work apart): the router's fp32
    softmax over ``n_experts`` (read, write) and its top-k choice (read); each of the ``top_k``
    rows gathered into expert order (read, write ``d_model``), multiplied by its gate (read, write)
    and added back into the token's output (read both, write: 3). Backward: the same rows
    scattered and gathered back (7 per row), the softmax's gradient (12 per expert). Index
    gathers and scatters stay kernels of their own under compile."""
    a = act_bytes
    rows = top_k * 7 * a * d_model
    return same(12 * n_experts + rows, 12 * n_experts + rows)


def cross_entropy(vocab_size: int, act_bytes: int, compiled_loss: bool) -> Traffic:
    """The loss over one token's ``vocab_size`` logits (``act_bytes`` each, as the head wrote them).
    Eager (the loss outside the compiled graph, compiled model or not): ``logits.float()``,
    ``log_softmax`` (reads its input for the maximum, for the sum of exponentials and to write: 12,
    writes 4), the label's gather (0); backward: the zero-filled fp32 gradient of the gather (4),
    ``log_softmax``'s gradient (its sum reads 4; reads gradient and output, writes 12), the cast back
    (4 + ``act_bytes``). ``compiled_loss`` (the loss in the compiled graph): the logits read twice
    (the maximum and the sum) forward, read and their gradient written backward."""
    a = act_bytes
    if compiled_loss:
        return same(2 * a, 2 * a) * vocab_size
    cast = to_fp32(a)
    return same(cast + 16, 4 + 16 + cast) * vocab_size
