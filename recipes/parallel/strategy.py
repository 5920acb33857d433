"""The Lightning side of ``trainer.strategy: fsdp``: :class:`ShardedStrategy` (Lightning's
``ModelParallelStrategy`` on the ``(pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp)`` mesh of
:mod:`yamlformer.recipes.parallel.mesh`)
starts the processes, builds the mesh, parallelises the model (:func:`yamlformer.recipes.parallel.parallelize`,
from the LightningModule's ``configure_model``) and saves checkpoints atomically; gradient
clipping across the meshes a tensor-parallel model's parameters live on (:class:`MeshClipping`,
for the precision plugin)."""

from __future__ import annotations

import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from yamlformer.builder.analysis.layout import Layout
from yamlformer.recipes.parallel import parallelize
from yamlformer.recipes.parallel.checkpoints import load_into_shards, save_sharded
from yamlformer.recipes.parallel.mesh import device_mesh, layout_of
from yamlformer.recipes.parallel.pipeline import build_pipeline
from yamlformer.recipes.recipe.sections import TrainerSection


def mesh_groups(parameters) -> dict:
    """Parameters with gradients, by the device mesh they live on (None: plain tensors)."""
    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return groups


def grad_norm(groups: dict) -> torch.Tensor:
    """The total gradient norm of :func:`mesh_groups`: each mesh's made whole, the squares summed."""

    norms = []
    for params in groups.values():
        norm = get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def on_mesh(total: torch.Tensor, mesh):
    """``total`` replicated on ``mesh`` (as is, for plain tensors), to clip that mesh's gradients with."""

    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False) if mesh else total


def clip_grad_norm(parameters, max_norm: float, group=None, leave_out=()) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on several meshes (tensor-parallel ones
    on ``(dp, tp)``, replicated ones on ``dp`` alone): each mesh's norm is made whole, the squares
    summed, and every gradient scaled by the one total. ``group``: the ``pp`` process group of a
    pipeline, whose stages each hold some of the parameters: their squares are summed over it too
    (torchtitan's ``clip_grad_norm_`` with a pp mesh); ``leave_out``: parameters scaled but not
    counted, another rank counting them (the last stage's copy of a tied table). Returns the
    total norm."""

    parameters = list(parameters)
    groups = mesh_groups(parameters)
    if len(groups) <= 1 and group is None:
        return torch.nn.utils.clip_grad_norm_([p for ps in groups.values() for p in ps], max_norm)
    skipped = {id(p) for p in leave_out}
    total = grad_norm(mesh_groups([p for p in parameters if id(p) not in skipped]))
    if group is not None:
        square = total**2
        dist.all_reduce(square, group=group)
        total = square.sqrt()
    for mesh, params in groups.items():
        clip_grads_with_norm_(params, max_norm, on_mesh(total, mesh))
    return total


class MeshClipping:
    """Gradient clipping across device meshes, for a Lightning precision plugin
    (``yamlformer.recipes.training.precision.lightning_plugin``)."""

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        clip_grad_norm(list(self.main_params(optimizer)), clip_val)


class ShardedStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` on a ``(pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp)``
    mesh, that parallelises the model itself (:meth:`parallelize`) and saves checkpoints
    atomically (:meth:`save_checkpoint`)."""

    def __init__(self, settings: TrainerSection, init_seed: int):
        super().__init__(save_distributed_checkpoint=True)
        self.settings = settings
        self.init_seed = init_seed
        self.layout: Layout | None = None
        self._parallelized: set[int] = set()

    # -- processes and mesh ------------------------------------------------------------------

    def setup_environment(self) -> None:
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        self.layout = layout_of(self.settings, per_node=self.num_processes)
        self._device_mesh = device_mesh(self.layout, self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """This rank's place among the data-parallel ranks (tensor- and context-parallel peers read the same data)."""
        mesh = self.device_mesh
        replicate, shard = mesh["dp_replicate"].get_local_rank(), mesh["dp_shard"].get_local_rank()
        return {"num_replicas": self.layout.data_parallel_size, "rank": replicate * mesh["dp_shard"].size() + shard}

    # -- the model ---------------------------------------------------------------------------

    def parallelize(self, model: nn.Module) -> nn.Module:
        """:func:`yamlformer.recipes.parallel.parallelize` on this strategy's mesh, materialised on this
        rank's device (once per model: ``configure_model`` runs for every stage)."""

        if id(model) not in self._parallelized:
            parallelize(model, self.settings, self.device_mesh, init_seed=self.init_seed, device=self.root_device)
            self._parallelized.add(id(model))
        return model

    def pipeline(self, model: nn.Module, loss_fn, balance_weight: float = 0.0):
        """This rank's part of ``model`` and its :class:`yamlformer.recipes.parallel.pipeline.Pipeline`
        (``trainer.pipeline_parallel``), each stage parallelised on the mesh's other dimensions."""

        def stage(view: nn.Module) -> nn.Module:
            return parallelize(view, self.settings, self.device_mesh, init_seed=self.init_seed, device=self.root_device)

        return build_pipeline(
            model, self.settings, self.device_mesh, self.root_device, loss_fn, stage, balance_weight=balance_weight
        )

    # -- checkpoints -------------------------------------------------------------------------

    def _whole_groups(self):
        """Under ``trainer.pipeline_parallel``: the function giving a stage's optimizer groups
        (named by ``get_optimizer_state_dict`` on the LightningModule) the whole model's names
        (:meth:`yamlformer.recipes.parallel.pipeline.Pipeline.whole_groups`); None otherwise."""
        module = self.lightning_module
        pipeline = getattr(module, "pipeline", None)
        if pipeline is None:
            return None
        prefix = next(name for name, child in module.named_children() if child is module.model) + "."
        return lambda groups: pipeline.whole_groups(groups, prefix)

    def optimizer_state(self, optimizer) -> dict:
        """Lightning's (every parameter's state by its name in the whole model), with a pipeline
        stage's groups naming every stage's parameters: what one process's groups name, so the
        checkpoint reads on any layout (``yamlformer.builder.checkpoints.read_whole`` numbers the state by
        them)."""
        state = super().optimizer_state(optimizer)
        whole = self._whole_groups()
        if whole is not None:
            state["param_groups"] = whole(state["param_groups"])
        return state

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Every rank writes its shards and their checksums into a temp folder beside
        ``filepath``; once all are done rank 0 seals ``meta.pt`` and renames the folder into place
        (``yamlformer.builder.checkpoints.save_sharded``). A rank killed before that leaves the previous checkpoint
        whole, and a temp folder the next save removes."""
        if storage_options is not None:
            raise TypeError("the sharded strategy takes no storage_options")
        path = Path(self.broadcast(str(filepath)))
        tmp = Path(self.broadcast(str(path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"))))
        save_sharded(checkpoint, path, tmp, self.global_rank, self.world_size, self.barrier)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """A sharded folder through Lightning (resharded to this layout); a file checkpoint (one
        process or DDP wrote it) through ``yamlformer.builder.checkpoints.load_into_shards``."""
        path = Path(self.broadcast(str(checkpoint_path)))  # every rank loads rank 0's choice
        if path.is_file():
            return load_into_shards(
                self.lightning_module,
                self.optimizers,
                path,
                strict=self.lightning_module.strict_loading,
                whole_groups=self._whole_groups(),
            )
        return super().load_checkpoint(path, weights_only=weights_only)
