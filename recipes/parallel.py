"""Sharded training (``trainer.strategy: fsdp``): FSDP2 and tensor parallelism through Lightning's
``ModelParallelStrategy``, a meta-device start and atomic sharded checkpoints.

The layout is a device mesh ``(dp_replicate, dp_shard, tp)``:

* ``data_parallel: shard`` — ``(1, world / tp, tp)``: parameters, gradients and optimizer state
  split over every data-parallel rank (FSDP2's ``fully_shard``);
* ``replicate`` — ``(world / tp, 1, tp)``: every rank keeps whole copies, gradients all-reduced;
* ``hybrid`` (HSDP) — ``(nodes, per_node / tp, tp)``: shard inside a node, replicate across nodes.

``tensor_parallel: T`` splits each layer's matrices over the ``tp`` ranks of one node as each
block's config declares (``parallel_plan``, applied by :mod:`recipes.tensor_parallel`).

The model arrives built on the ``meta`` device. :meth:`ShardedStrategy.parallelize` (called from
the LightningModule's ``configure_model``) applies tensor parallelism, per-layer activation
checkpointing and ``torch.compile`` as asked, makes every Transformer layer, each embedding and
the head a ``fully_shard`` unit (a head tied to its embedding shares the root unit) with a
mixed-precision policy from ``trainer.precision`` (bf16-mixed: bf16 parameters and compute,
fp32 gradient reduction, fp32 master weights and AdamW state), and then materialises only this
rank's shards: ``to_empty`` and :func:`blocks.init.fill` of each shard's rows, which are exactly
the values a single-process build draws there (``blocks.init`` seeds every parameter by name).
"""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from builder.analysis.layout import Layout, LayoutError
from recipes.recipe.sections import RecipeError, TrainerSection

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
#: groups of mesh dimensions also made one dimension: a DTensor reduction over several of them (the
#: gradient norm of a sharded, tensor-parallel weight) is then one all-reduce, not one per
#: dimension in sequence (slower, and its rounding may differ between ranks)
FLATTENED = (("dp_replicate", "dp_shard"), ("dp_shard", "tp"), ("dp_replicate", "dp_shard", "tp"))


def mesh_shape(layout: Layout) -> tuple[int, int, int]:
    """``(dp_replicate, dp_shard, tp)`` of a layout, the order ``builder.analysis.layout`` numbers ranks in."""
    return layout.replicas, layout.shard_size, layout.tensor_parallel


def cpu_process_limit() -> int:
    """The most CPU processes a run may start on this machine: four per core (at least 8), room to
    prove a multi-process layout on a small machine, not a fork bomb from a typo."""
    return max(8, 4 * (os.cpu_count() or 1))


def device_count(settings: TrainerSection) -> int:
    """The processes per node the recipe asks for, checked against the machine: a located
    :class:`RecipeError` for CUDA devices that are not there (before any data or model work)."""
    accelerator = settings.accelerator
    cuda = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    devices = settings.devices
    if not cuda:
        if accelerator not in ("cpu", "auto"):
            return devices if isinstance(devices, int) and devices > 0 else 1
        if isinstance(devices, int) and devices > 0:
            limit = cpu_process_limit()
            if devices > limit:
                raise RecipeError(
                    f"trainer.devices {devices}: on the CPU each device is a process; this machine "
                    f"has {os.cpu_count() or 1} cores, so at most {limit}"
                )
            return devices
        if devices in ("auto", -1, "-1"):
            return 1
        raise RecipeError(f"trainer.devices {devices!r}: on the CPU give a number of processes")
    available = torch.cuda.device_count()
    if available == 0:
        raise RecipeError(f"trainer.accelerator {accelerator}: this machine has no CUDA device; use cpu")
    if devices in ("auto", -1, "-1"):
        return available
    if isinstance(devices, int):
        if devices > available:
            raise RecipeError(
                f"trainer.devices {devices}: this machine has {available} CUDA device{'s' if available != 1 else ''}"
            )
        return devices
    ids = [int(i) for i in str(devices).replace(",", " ").split()] if str(devices).strip() else []
    missing = [i for i in ids if i >= available]
    if missing:
        raise RecipeError(f"trainer.devices {devices!r}: no CUDA device {missing[0]} (this machine has {available})")
    return len(ids)


def layout_of(settings: TrainerSection, per_node: int | None = None) -> Layout:
    """The recipe's layout (``per_node`` processes per node, default: what the machine has for
    ``trainer.devices``), checked: a :class:`RecipeError` names the field that makes it impossible."""
    per_node = device_count(settings) if per_node is None else per_node
    try:
        return Layout(
            devices=per_node * settings.num_nodes,
            nodes=settings.num_nodes,
            tensor_parallel=settings.tensor_parallel,
            data_parallel=settings.data_parallel,
        )
    except LayoutError as exc:
        raise RecipeError(f"trainer.{exc.argument} {exc.value}: {exc.reason}") from None


def mixed_precision(precision: str):
    """FSDP2's policy for a recipe precision: bf16-mixed computes in bf16 and reduces gradients
    in fp32 while the sharded parameters (the optimizer's master copy) stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on several meshes (tensor-parallel ones
    on ``(dp, tp)``, replicated ones on ``dp`` alone): each mesh's norm is made whole, the squares
    summed, and every gradient scaled by the one total. Returns the total norm."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_([p for ps in groups.values() for p in ps], max_norm)
    norms = []
    for params in groups.values():
        norm = get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for mesh, params in groups.items():
        whole = DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False) if mesh else total
        clip_grads_with_norm_(params, max_norm, whole)
    return total


class MeshClipping:
    """Gradient clipping across device meshes, for a Lightning precision plugin
    (``recipes.training.precision.lightning_plugin``)."""

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        clip_grad_norm(list(self.main_params(optimizer)), clip_val)


class ShardedStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` on a ``(dp_replicate, dp_shard, tp)`` mesh, that shards the
    model itself (:meth:`parallelize`) and saves checkpoints atomically (:meth:`save_checkpoint`)."""

    def __init__(self, settings: TrainerSection, init_seed: int):
        super().__init__(save_distributed_checkpoint=True)
        self.settings = settings
        self.init_seed = init_seed
        self.layout: Layout | None = None
        self._parallelized: set[int] = set()

    # -- processes and mesh ------------------------------------------------------------------

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        self.layout = layout_of(self.settings, per_node=self.num_processes)
        self._device_mesh = init_device_mesh(self.root_device.type, mesh_shape(self.layout), mesh_dim_names=MESH_DIMS)
        for dims in FLATTENED:  # one collective over several dimensions (DTensor looks these up), as torchtitan does
            self._device_mesh[dims]._flatten("_".join(dims))
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """This rank's place among the data-parallel ranks (tensor-parallel peers read the same data)."""
        mesh = self.device_mesh
        replicate, shard = mesh["dp_replicate"].get_local_rank(), mesh["dp_shard"].get_local_rank()
        return {"num_replicas": self.layout.data_parallel_size, "rank": replicate * mesh["dp_shard"].size() + shard}

    # -- the model ---------------------------------------------------------------------------

    def parallelize(self, model: nn.Module) -> nn.Module:
        """:func:`shard_model` on this strategy's mesh (once per model: ``configure_model`` runs
        for every stage)."""
        if id(model) not in self._parallelized:
            shard_model(model, self.device_mesh, self.settings, self.init_seed, self.root_device)
            self._parallelized.add(id(model))
        return model

    # -- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Every rank writes its shards and their checksums into a temp folder beside
        ``filepath``; once all are done rank 0 seals ``meta.pt`` and renames the folder into place
        (``recipes.sharded_checkpoint``). A rank killed before that leaves the previous checkpoint
        whole, and a temp folder the next save removes."""
        from recipes.sharded_checkpoint import save

        if storage_options is not None:
            raise TypeError("the sharded strategy takes no storage_options")
        path = Path(self.broadcast(str(filepath)))
        tmp = Path(self.broadcast(str(path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"))))
        save(checkpoint, path, tmp, self.global_rank, self.world_size, self.barrier)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """A sharded folder through Lightning (resharded to this layout); a file checkpoint (one
        process or DDP wrote it) through ``recipes.sharded_checkpoint.load_file``."""
        from recipes.sharded_checkpoint import load_file

        path = Path(self.broadcast(str(checkpoint_path)))  # every rank loads rank 0's choice
        if path.is_file():
            return load_file(self.lightning_module, self.optimizers, path, strict=self.lightning_module.strict_loading)
        return super().load_checkpoint(path, weights_only=weights_only)


def shard_model(model: nn.Module, mesh, settings: TrainerSection, init_seed: int, device: torch.device) -> nn.Module:
    """Tensor-parallel plans, activation checkpointing, compile, ``fully_shard`` units over the
    data-parallel dims of ``mesh`` (``MESH_DIMS``), then this rank's shards materialised when the
    model is on the meta device."""
    from torch.distributed.fsdp import fully_shard

    from recipes.training.module import checkpoint_layers, layer_modules
    from recipes.training.speed import compile_layers, compile_mode

    if mesh["tp"].size() > 1:
        from recipes.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    layers = layer_modules(model)
    if settings.activation_checkpointing:
        checkpoint_layers(model)
    if compile_mode(settings) == "layers":  # config refuses "model" under fsdp
        compile_layers(layers)
    # FSDP2 warns when a unit returns a view: an in-place op on it would drop FSDP's pre-backward
    # hook. The root unit's output is the model's logits (a view under tensor parallelism), which
    # every task's loss reads out of place only (reshape, float, cross_entropy), so it does not
    # apply there; a view returned by any other unit (a layer, an embedding) still warns.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+Model\) returned a view tensor")
    dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    policy = mixed_precision(settings.precision)
    for unit in [*layers, *separate_units(model)]:
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    if any(p.is_meta for p in model.parameters()):
        materialize(model, device, init_seed)
    return model


def separate_units(model: nn.Module) -> list[nn.Module]:
    """The embeddings and the head, each its own ``fully_shard`` unit unless it shares a tensor
    with another of them (a tied head and its embedding stay in the root unit together)."""
    candidates: list[nn.Module] = []
    for stack in model.stacks().values() if hasattr(model, "stacks") else []:
        if all(stack.embedding is not c for c in candidates):
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
    build has there (``blocks.init``): each shard draws only the rows it holds."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from blocks.init import canonical_name, fill, init_rules

    model.to_empty(device=device)
    rules = init_rules(model)
    for name, param in model.named_parameters():
        key = canonical_name(name)
        if key not in rules:
            raise RecipeError(
                f"parameter {key} has no init rule in blocks.init, so a sharded start cannot initialise it"
            )
        if isinstance(param, DTensor):
            local = param.to_local()
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            if tuple(shape) != tuple(local.shape):
                raise RuntimeError(f"{key}: local shard {tuple(local.shape)} is not the expected {tuple(shape)}")
            fill(local, rules[key], seed, key, tuple(param.shape), tuple(offset))
        else:
            fill(param.data, rules[key], seed, key, tuple(param.shape))


def data_parallel_size(trainer) -> int:
    """Ranks that read different data (the world, or the world over the tensor-parallel degree)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size))


def data_parallel_rank(trainer) -> int:
    """This rank's place among those that read different data (tensor-parallel peers share one)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", trainer.global_rank))


def local_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards; whole tensors when not sharded)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def is_sharded_model(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def whole_model(module) -> nn.Module | None:
    """A LightningModule's model whole, for work one rank does alone (samples, beam search):
    the model itself when it is not sharded; else gathered into a CPU copy on rank 0 (``None``
    on the other ranks). Every rank must call it."""
    model = module.model
    if not is_sharded_model(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from builder.checkpoints import empty_model

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if module.trainer.global_rank != 0:
        return None
    host = empty_model(model.spec.model_dump(mode="json"))
    host.load_state_dict(state)
    return host.eval()
