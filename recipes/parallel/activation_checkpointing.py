"""Activation checkpointing (``trainer.activation_checkpointing``), the second step of
:func:`yamlformer.recipes.parallel.parallelize`: each Transformer layer recomputes its forward in the
backward pass instead of keeping its activations (less memory, one more forward per layer).
Applied after tensor parallelism and before compile and FSDP, as torchtitan orders them, so a
compiled layer traces the recomputation and a ``fully_shard`` unit gathers its parameters again
for it."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The model's Transformer layers: each stack's ``layers`` (else its outermost lists of like
    modules, for models not built by ``build_model``)."""
    if hasattr(model, "stacks"):
        return [layer for stack in model.stacks().values() for layer in stack.layers]
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            if not any(name.startswith(outer + ".") for outer, _ in found):
                found.append((name, module))
    return [layer for _, modules in found for layer in modules]


def checkpoint_layers(model: nn.Module) -> int:
    """Recompute each layer's activations in the backward pass instead of keeping them (in
    training with gradients only: evaluation and decoding run the layer as built). Returns how
    many layers."""

    layers = layer_modules(model)
    for layer in layers:
        forward = layer.forward

        @functools.wraps(forward)
        def checkpointed(*args, _forward=forward, _layer=layer, **kwargs):
            if _layer.training and torch.is_grad_enabled():
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return _forward(*args, **kwargs)

        layer.forward = checkpointed
    return len(layers)
