"""FSDP2 (``fully_shard``), the last step of :func:`yamlformer.recipes.parallel.parallelize`: every
Transformer layer, each embedding and the head a shard unit over the data-parallel dimensions of
the mesh (a head tied to its embedding shares the root unit), with a mixed-precision policy from
``trainer.precision``; then a model built on the meta device gets only this rank's shards
(:func:`materialize`). Also what reads a sharded model back: its local bytes, and the whole model
gathered on rank 0 (:func:`whole_model`)."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from yamlformer.blocks.init import STD, canonical_name, fill, imperative_modules, init_from_weights, init_rules
from yamlformer.builder.checkpoints import empty_model
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.parallel.mesh import SHARD_DIM


def mixed_precision(precision: str):
    """FSDP2's policy for a recipe precision: bf16-mixed computes in bf16 and reduces gradients
    in fp32 while the sharded parameters (the optimizer's master copy) stay fp32."""

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(
    model: nn.Module,
    layers: list[nn.Module],
    mesh,
    precision: str,
    experts: list[nn.Module] = (),
    *,
    reshard_after_forward: bool = True,
) -> None:
    """``fully_shard`` on each of ``layers``, on the separate embeddings and head
    (:func:`separate_units`) and on the root, over the data-parallel dimensions of ``mesh``
    (``dp_replicate`` too when it has more than one rank: HSDP). ``reshard_after_forward=False``
    (a pipeline stage, as torchtitan shards one) keeps a unit's parameters gathered from its
    forward to its backward: one all-gather a step instead of two per micro-batch, and the split
    backward of the zero-bubble schedules needs it (torch's weight pass differentiates the
    parameters the stage holds when it runs, which must be the gathered ones its forward used, or
    that unit's weight gradients are lost). ``experts`` (split over ``ep``
    by :mod:`.expert`) are units of their own first, over the data-parallel ranks outside
    ``ep``; their gradients, which already sum every ``ep`` rank's tokens, are divided by the
    whole data- and context-parallel degree the dense gradients are averaged over (a sum
    reduction, then the division: gloo has no pre-scaled sum)."""

    # FSDP2 warns when a unit returns a view: an in-place op on it would drop FSDP's pre-backward
    # hook. The root unit's output is the model's logits (a view under tensor parallelism), which
    # every task's loss reads out of place only (reshape, float, cross_entropy), and a split
    # experts unit's is its grouped matmul's rows, which ``yamlformer.blocks.experts.dispatch`` reads out of
    # place only (a product with the gates, ``index_copy`` and ``index_add`` into new tensors), so
    # it does not apply there; a view returned by any other unit (a layer, an embedding) still warns.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+(Model|Experts)\) returned a view tensor")

    dp_mesh = mesh["dp_replicate", SHARD_DIM] if mesh["dp_replicate"].size() > 1 else mesh[SHARD_DIM]
    policy = mixed_precision(precision)
    if experts:
        expert_mesh = (
            mesh["dp_replicate", "dp_shard_mod_ep"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard_mod_ep"]
        )
        # every data-parallel and context-parallel rank's tokens: the dense parameters' mean
        degree = mesh["dp_replicate"].size() * mesh[SHARD_DIM].size()
        for unit in experts:
            fully_shard(unit, mesh=expert_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
            if expert_mesh.size() > 1:  # alone, FSDP2 divides by the factor once; with it, twice
                unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(float(degree))
    for unit in [*layers, *separate_units(model)]:
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def separate_units(model: nn.Module) -> list[nn.Module]:
    """The embeddings and the head, each its own ``fully_shard`` unit unless it shares a tensor
    with another of them (a tied head and its embedding stay in the root unit together)."""
    candidates: list[nn.Module] = []
    for stack in model.stacks().values() if hasattr(model, "stacks") else []:
        if stack.embedding is not None and all(stack.embedding is not c for c in candidates):
            candidates.append(stack.embedding)
    if isinstance(getattr(model, "head", None), nn.Module):
        candidates.append(model.head)
    owners: dict[int, int] = {}
    for module in candidates:
        for p in module.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [
        m for m in candidates if any(True for _ in m.parameters()) and all(owners[id(p)] == 1 for p in m.parameters())
    ]


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate this rank's shards on ``device`` and fill them with the values a whole-model
    build has there (``yamlformer.blocks.init`` seeds every parameter by name): each shard draws only the
    rows it holds. Buffers (DeepSeekMoE's expert bias and load) are set by their modules'
    ``init_weights`` first, as a whole-model build sets them."""

    model.to_empty(device=device)
    for _, module in imperative_modules(model):  # before the rules: those parameters are theirs
        module.init_weights(STD)
    rules = init_rules(model)
    for name, param in model.named_parameters():
        key = canonical_name(name)
        if key not in rules:
            raise RecipeError(
                f"parameter {key} has no init rule in yamlformer.blocks.init, so a sharded start cannot initialise it"
            )
        if isinstance(param, DTensor):
            local = param.to_local()
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            if tuple(shape) != tuple(local.shape):
                raise RuntimeError(f"{key}: local shard {tuple(local.shape)} is not the expected {tuple(shape)}")
            fill(local, rules[key], seed, key, tuple(param.shape), tuple(offset))
        else:
            fill(param.data, rules[key], seed, key, tuple(param.shape))
    init_from_weights(model)  # what follows from the weights (DoRA's magnitude: the norm of each shard's rows)


# -- reading a sharded model ----------------------------------------------------------------------


def local_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards; whole tensors when not sharded)."""

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def is_sharded_model(model: nn.Module) -> bool:
    """Whether any parameter is a DTensor (split by FSDP2 or tensor parallelism)."""

    return any(isinstance(p, DTensor) for p in model.parameters())


def whole_model(module) -> nn.Module | None:
    """A LightningModule's model whole, for work one rank does alone (samples, beam search):
    the model itself when it is not sharded; else gathered into a CPU copy on rank 0 (``None``
    on the other ranks). Every rank must call it."""
    model = module.model
    if not is_sharded_model(model):
        return model

    pipeline = getattr(module, "pipeline", None)
    # offloaded, a whole state is rank 0's alone; a pipeline's every stage sends its own. Split
    # experts FSDP-sharded too are 2-D DTensors that DTensor gathers dimension by dimension, and
    # says so (its logger's warning that the gathers are not merged): exact, and once a run
    with _quiet("torch.distributed.tensor._redistribute"):
        options = StateDictOptions(full_state_dict=True, cpu_offload=pipeline is None)
        state = get_model_state_dict(model, options=options)
    if pipeline is not None:  # each stage's rank holds its layers: rank 0's pipeline gathers them
        state = {key: value.cpu() for key, value in state.items()}
        state = _gather_stages(state, pipeline.group, module.trainer.global_rank)
    if module.trainer.global_rank != 0:
        return None
    host = empty_model(model.spec.model_dump(mode="json"))
    host.load_state_dict(state)
    return host.eval()


@contextmanager
def _quiet(name: str):
    """The ``logging`` logger ``name`` at ERROR inside the block, as it was after."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _gather_stages(state: dict, group, rank: int) -> dict | None:
    """The whole model's state on rank 0, from the stages of its pipeline ``group`` (each a
    rank's own tensors); the ranks of other pipelines (other data-parallel coordinates) hold the
    same and send nothing."""

    if 0 not in dist.get_process_group_ranks(group):
        return None
    parts = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(state, parts, group=group, group_dst=0)
    return {key: value for part in parts for key, value in part.items()} if rank == 0 else None
