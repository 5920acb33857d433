"""Context parallelism (``trainer.context_parallel: C``): each sequence split between the ``C``
ranks of the mesh's ``cp`` dimension, which read the same micro-batch (their data-parallel
rank's). Called from :func:`yamlformer.recipes.parallel.parallelize` after tensor parallelism.

The attention side is each attention block's (``use_context_parallel(group)``: Llama 3's
all-gather context parallelism, the Llama 3 paper's section 3.3.2; every rank scores its own
queries against the keys and values gathered from the group, masked by token index). PyTorch's
``torch.distributed.tensor.experimental.context_parallel`` is not used: it replaces only the
fused CUDA SDPA kernels (flash, memory-efficient, cuDNN) with ``is_causal`` and no mask, so it
neither runs on the CPU nor takes a sliding window, chunks, ALiBi, sinks or soft-capping.

This module holds the input side: with causal load balancing the sequence is cut into ``2C``
equal chunks and rank ``r`` holds chunks ``r`` and ``2C - 1 - r`` (as torch's and Megatron's
context parallelism do), so every rank scores about as many (query, key) pairs under a causal
mask. :class:`ContextShard` slices a batch's inputs and targets so and gives the tokens' places
in the whole sequence (their positions: RoPE, learned tables and the masks follow them).

The loss each rank computes is the mean over its share of the tokens; the shares are equal, so
the mean over the ``cp`` ranks is the whole sequence's mean: the training loss is already
averaged over every rank, and FSDP's shard group spans the data-parallel and context-parallel
ranks (``dp_shard_cp``), so the gradients are averaged over both.
"""

from __future__ import annotations

import torch
from torch import nn

from yamlformer.builder.analysis.layout_rules import context_parallel_problems
from yamlformer.recipes.errors import RecipeError


def load_balanced_index(seq_len: int, rank: int, degree: int, device=None) -> torch.Tensor:
    """``(seq_len / degree,)`` the token indices rank ``rank`` of ``degree`` holds: chunks ``rank``
    and ``2 * degree - 1 - rank`` of ``2 * degree`` equal chunks."""
    if seq_len % (2 * degree):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {degree} equal chunks")
    chunk = seq_len // (2 * degree)
    first, second = rank * chunk, (2 * degree - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)]).to(device)


class ContextShard:
    """This rank's share of every sequence of a context-parallel group (``cp_mesh``, the mesh's
    ``cp`` dimension)."""

    def __init__(self, cp_mesh):
        self.rank, self.degree = cp_mesh.get_local_rank(), cp_mesh.size()
        self._index: dict = {}

    def token_index(self, seq_len: int, device) -> torch.Tensor:
        """The whole-sequence indices of this rank's tokens (:func:`load_balanced_index`)."""
        key = (seq_len, str(device))
        if key not in self._index:
            self._index[key] = load_balanced_index(seq_len, self.rank, self.degree, device)
        return self._index[key]

    def split(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each ``(batch, seq, ...)`` tensor's tokens of this rank (inputs, targets)."""
        index = self.token_index(tensors[0].shape[1], tensors[0].device)
        return tuple(t.index_select(1, index) for t in tensors)


def apply_context_parallel(model: nn.Module, cp_mesh) -> ContextShard:
    """Make every attention of ``model`` (a ``build_model`` decoder-only model) attend over the
    sequence split between the ranks of ``cp_mesh``; returns the input side (:class:`ContextShard`).
    A RecipeError naming ``trainer.context_parallel`` and the spec's field for a model whose blocks
    say they cannot (``context_parallel_problems``: an attention without a context-parallel path,
    a head with attention layers of its own)."""

    degree = cp_mesh.size()
    problems = context_parallel_problems(model.spec, degree)  # each block's own contract, as the planner asks
    if problems:
        where, message = problems[0]
        raise RecipeError(f"trainer.context_parallel {degree}: {'.'.join(map(str, where))}: {message}")
    group = cp_mesh.get_group()
    for module in model.modules():  # the attentions, and the blocks whose statistics span a sequence (experts)
        if hasattr(module, "use_context_parallel"):
            module.use_context_parallel(group)
    return ContextShard(cp_mesh)
