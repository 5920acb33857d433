"""Optimizers as registered kinds (torch-free): what a recipe's ``optimizer:`` section may be.

An optimizer is a config class registered under its YAML ``type`` (``adamw``, the default;
``muon``; ``sgd``; a package adds its own through the ``yamlformer.optimizers`` entry-point group or
``--plugin``, as blocks join theirs). It declares what generic code asks of it
(:class:`~yamlformer.builder.optim.registry.OptimizerConfig`): its parameter groups (which tensors
it trains how, from the blocks' tensor classes and the spec's parametrization,
``yamlformer.builder.parametrization``), the state it keeps per parameter, and the torch class that
runs it (by import path, built by ``yamlformer.recipes.optim``). The memory estimate, the per-rank
shards and the planner count the state through :func:`optimizer_state_bytes` alone.
"""

from __future__ import annotations

from yamlformer.builder.optim.registry import (
    DEFAULT,
    GROUP,
    Group,
    OptimizerConfig,
    OptimizerError,
    StateBytes,
    Trainable,
    config_class,
    optimizer_configs,
    optimizer_field,
    optimizer_named,
    optimizer_state_bytes,
    register,
)

__all__ = [
    "DEFAULT",
    "GROUP",
    "Group",
    "OptimizerConfig",
    "OptimizerError",
    "StateBytes",
    "Trainable",
    "config_class",
    "optimizer_configs",
    "optimizer_field",
    "optimizer_named",
    "optimizer_state_bytes",
    "register",
]
