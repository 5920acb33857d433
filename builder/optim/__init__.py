"""Optimizers as registered kinds (torch-free): what a recipe's ``optimizer:`` section may be.

An optimizer is a config class registered under its YAML ``type`` (``adamw``, the default;
``muon``; ``sgd``; a package adds its own through the ``yamlformer.optimizers`` entry-point group or
``--plugin``, as blocks join theirs). It declares what generic code asks of it
(:class:`~yamlformer.builder.optim.registry.OptimizerConfig`): its parameter groups (which tensors
it trains how, from the blocks' tensor classes and the spec's parametrization,
``yamlformer.builder.parametrization``) and the state it keeps per parameter; the torch optimizer
each type builds is registered by the recipes (``yamlformer.recipes.optim.implements``), which this
layer never names. The memory estimate, the per-rank shards and the planner count the state
through :func:`optimizer_state_bytes` alone. Importing this package registers the built-in ones
(:mod:`.configs`).
"""

from __future__ import annotations

from yamlformer.builder.optim import configs  # registers the built-in optimizers
from yamlformer.builder.optim.registry import (
    DEFAULT,
    GROUP,
    OPTIMIZERS,
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
    "OPTIMIZERS",
    "Group",
    "OptimizerConfig",
    "OptimizerError",
    "StateBytes",
    "Trainable",
    "config_class",
    "configs",
    "optimizer_configs",
    "optimizer_field",
    "optimizer_named",
    "optimizer_state_bytes",
    "register",
]
