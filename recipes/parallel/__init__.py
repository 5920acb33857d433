"""Parallelism: how a built model is spread over devices and made fast to train, applied by one
function, :func:`parallelize`, in a fixed order (torchtitan's ``parallelize_llama``):

1. tensor parallelism (:mod:`.tensor`: each block's ``parallel_plan``, over the ``tp`` dimension),
   then context parallelism (:mod:`.context`: each attention's ``use_context_parallel``, over ``cp``)
   or expert parallelism (:mod:`.expert`: each mixture of experts' routed experts split over the
   ``ep`` dimension, tokens sent to them by all-to-all; not yet together with ``cp``);
2. activation checkpointing (:mod:`.activation_checkpointing`: each Transformer layer);
3. ``torch.compile`` (:mod:`.compile`: each layer, after checkpointing so it traces the recompute);
4. FSDP2 (:mod:`.fsdp`: ``fully_shard`` units over the data-parallel dimensions, then a meta-device
   model's shards materialised).

One device (or DDP) takes steps 2 and 3; ``trainer.strategy: fsdp`` takes all four on the device
mesh of :mod:`.mesh` (``(pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp)``, the one place
``trainer.devices`` becomes a count), through Lightning's ``ModelParallelStrategy`` (:mod:`.strategy`).

Pipeline parallelism (:mod:`.pipeline`, ``trainer.pipeline_parallel``) comes first: the model is
cut into stages by its own contract (``pipeline_part``) and :func:`parallelize` then runs on each
stage alone, over the mesh's other dimensions; the LightningModule drives the stages' schedule.

A new dimension is one file here with its ``apply``
function, called from :func:`parallelize` at its place in the order, plus one dimension of the
layout model (``yamlformer.builder.analysis.layout.Layout``: its degree, its place in the rank numbering,
what a rank then holds), which :func:`.mesh.mesh_shape` turns into a mesh dimension.
"""

from __future__ import annotations

import torch
from torch import nn

from yamlformer.recipes.parallel.activation_checkpointing import checkpoint_layers, layer_modules
from yamlformer.recipes.parallel.compile import compile_layers, compile_mode
from yamlformer.recipes.parallel.context import apply_context_parallel
from yamlformer.recipes.parallel.expert import apply_expert_parallel
from yamlformer.recipes.parallel.fsdp import apply_fsdp, is_sharded_model, local_bytes, materialize, whole_model
from yamlformer.recipes.parallel.mesh import (
    MESH_DIMS,
    data_parallel_rank,
    data_parallel_size,
    device_count,
    layout_of,
    mesh_shape,
)
from yamlformer.recipes.parallel.tensor import apply_tensor_parallel
from yamlformer.recipes.recipe.sections import TrainerSection

__all__ = [
    "MESH_DIMS",
    "data_parallel_rank",
    "data_parallel_size",
    "device_count",
    "is_sharded_model",
    "layout_of",
    "local_bytes",
    "mesh_shape",
    "parallelize",
    "whole_model",
]


def parallelize(
    model: nn.Module,
    settings: TrainerSection,
    mesh=None,
    *,
    init_seed: int | None = None,
    device: torch.device | None = None,
) -> nn.Module:
    """Apply tensor and expert parallelism, activation checkpointing, torch.compile and data
    parallelism (FSDP2) to ``model``, in that order, as the recipe's ``trainer`` section asks.

    Args:
        model: a ``build_model`` model; preferably on the meta device when ``mesh`` is given
            (each rank then allocates only its shards), else on the device it trains on.
        settings: the recipe's ``trainer`` section (``activation_checkpointing``, ``compile``,
            ``precision``).
        mesh: the ``MESH_DIMS`` device mesh of a sharded run (:func:`.mesh.device_mesh`); None on
            one device or under DDP, where only checkpointing and compile apply.
        init_seed: the seed a meta-device model's shards are drawn with (``trainer.seed``).
        device: where a meta-device model's shards are allocated (this rank's device).

    Returns the model, changed in place. ``compile: model`` (the loss and its backward as one
    graph) is the LightningModule's (:func:`.compile.compiled_losses`), not a step here.
    """
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if mesh is not None and mesh["cp"].size() > 1:
        model.context_shard = apply_context_parallel(model, mesh["cp"])  # how the training step splits a batch
    experts = apply_expert_parallel(model, mesh["ep"]) if mesh is not None and mesh["ep"].size() > 1 else []
    layers = layer_modules(model)
    if settings.activation_checkpointing:
        checkpoint_layers(model)
    if compile_mode(settings) == "layers":  # after checkpointing, before fully_shard (torchtitan's order)
        compile_layers(layers)
    if mesh is not None:
        # a pipeline stage keeps its gathered parameters through its micro-batches (torchtitan's policy)
        staged = settings.pipeline_parallel > 1
        apply_fsdp(model, layers, mesh, settings.precision, experts, reshard_after_forward=not staged)
        if any(p.is_meta for p in model.parameters()):
            materialize(model, device, init_seed)
    return model
