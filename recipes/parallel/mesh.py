"""The device mesh of a run: its dimensions, the processes per node the machine gives a recipe's
``trainer.devices`` (the one place a device count is derived), the recipe's layout
(:class:`yamlformer.builder.analysis.layout.Layout`) and each rank's place among those that read different data.

The mesh is ``(pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp)``, numbered as
``yamlformer.builder.analysis.layout`` numbers ranks (torchtitan's names). The pipeline stages are outermost
(``pp`` is 1 unless ``trainer.pipeline_parallel``). ``dp_shard`` is the flattened
``(dp_shard_mod_ep, dp_shard_in_ep)``, the data-parallel shard ranks; ``cp`` holds the
context-parallel ranks, which FSDP shards over together with them, as ``dp_shard_cp``. Expert
parallelism borrows its ranks innermost from that shard group, as torchtitan does: the context-
parallel ranks first, then ``dp_shard_in_ep`` data-parallel ones, so ``ep`` is the flattened
``(dp_shard_in_ep, cp)`` of ``trainer.expert_parallel`` ranks (which must then be a multiple of
``trainer.context_parallel``), and FSDP shards the experts over the ranks outside it,
``dp_replicate x dp_shard_mod_ep`` — dimensions in the root mesh's order, as FSDP2 needs.
Without expert parallelism ``dp_shard_in_ep`` and ``ep`` are 1. With ``stage`` the ranks of one
pipeline stage (``world / pp``) and ``E`` the data-parallel ranks ``ep`` borrows
(``expert_parallel / context_parallel``, else 1):

* ``data_parallel: shard`` — ``(pp, 1, stage / (E x cp x tp), E, cp, tp)``: parameters, gradients and
  optimizer state split over every data-parallel (and context-parallel) rank;
* ``replicate`` — ``(pp, stage / (cp x tp), 1, 1, cp, tp)``: every data-parallel rank keeps whole
  copies (split over its context-parallel ranks only), gradients all-reduced;
* ``hybrid`` (HSDP) — ``(pp, nodes / pp, per_node / (E x cp x tp), E, cp, tp)``: shard inside a node,
  replicate across nodes.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh

from yamlformer.builder.analysis.layout import Layout, LayoutError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.sections import TrainerSection

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
#: the data-parallel shard ranks (``dp_shard``), made one dimension of the mesh dimensions they span
#: (first: the groups below use it)
SHARD_DIMS = ("dp_shard_mod_ep", "dp_shard_in_ep")
#: groups of mesh dimensions also made one dimension: a DTensor reduction over several of them (the
#: gradient norm of a sharded, tensor-parallel weight) is then one all-reduce, not one per
#: dimension in sequence (slower, and its rounding may differ between ranks)
FLATTENED = (
    ("dp_replicate", "dp_shard"),
    ("dp_shard", "tp"),
    ("dp_replicate", "dp_shard", "tp"),
    ("dp_shard", "cp"),  # FSDP's shard group
    ("dp_replicate", "dp_shard", "cp"),
    ("dp_shard", "cp", "tp"),
    ("dp_replicate", "dp_shard", "cp", "tp"),
)
#: FSDP2's shard dimension: the data-parallel shard ranks and the context-parallel ranks
SHARD_DIM = "dp_shard_cp"
#: the ranks of one pipeline stage (every dimension but ``pp``): those holding the same layers
PIPELINE_PEERS = "dp_replicate_dp_shard_cp_tp"


def mesh_shape(layout: Layout) -> tuple[int, ...]:
    """``MESH_DIMS`` sizes of a layout, the order ``yamlformer.builder.analysis.layout`` numbers ranks in."""
    borrowed = borrowed_data_parallel(layout)
    return (
        layout.pipeline_parallel,
        layout.replicas,
        layout.data_parallel_shard // borrowed,
        borrowed,
        layout.context_parallel,
        layout.tensor_parallel,
    )


def borrowed_data_parallel(layout: Layout) -> int:
    """The data-parallel shard ranks expert parallelism borrows (``dp_shard_in_ep``): its degree
    over the context-parallel ranks it takes first; 1 without it."""
    if layout.expert_parallel == 1:
        return 1
    return layout.expert_parallel // layout.context_parallel


def expert_dims(layout: Layout) -> tuple[str, ...]:
    """The mesh dimensions the ``ep`` group spans: the borrowed data-parallel ranks, and under
    expert parallelism the context-parallel ranks too."""
    return ("dp_shard_in_ep", "cp") if layout.expert_parallel > 1 else ("dp_shard_in_ep",)


def device_mesh(layout: Layout, device_type: str):
    """The ``MESH_DIMS`` mesh of ``layout`` over the processes that exist (a process group is
    up), with ``dp_shard`` (:data:`SHARD_DIMS`), ``ep`` (:func:`expert_dims`) and the
    :data:`FLATTENED` groups made dimensions too, as torchtitan does."""

    # torch warns that slicing a flattened dimension (dp_shard) from the root mesh is to be
    # deprecated; it is how DTensor and FSDP2 find these groups by name today
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    mesh = init_device_mesh(device_type, mesh_shape(layout), mesh_dim_names=MESH_DIMS)
    mesh[SHARD_DIMS]._flatten("dp_shard")
    mesh[expert_dims(layout)]._flatten("ep")
    for dims in FLATTENED:  # DTensor looks these up by name
        mesh[dims]._flatten("_".join(dims))
    return mesh


# -- devices --------------------------------------------------------------------------------------


def cpu_process_limit() -> int:
    """The most CPU processes a run may start on this machine: four per core (at least 8), room to
    prove a multi-process layout on a small machine, not a fork bomb from a typo."""
    return max(8, 4 * (os.cpu_count() or 1))


def accelerator_of(accelerator: str) -> str:
    """The accelerator Lightning runs ``trainer.accelerator`` on here: ``auto`` and ``gpu`` made
    ``cuda``, ``mps`` or ``cpu`` as this machine has them; the others as written."""

    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if accelerator == "auto":
        return "cuda" if cuda else "mps" if mps else "cpu"
    if accelerator == "gpu":
        return "cuda" if cuda or not mps else "mps"
    return accelerator


def device_count(settings: TrainerSection, check: bool = True) -> int:
    """The processes per node ``trainer.devices`` (normalised by :class:`TrainerSection`: a count,
    a list of device indices, ``auto`` or ``-1``) makes on this machine's accelerator: ``auto`` and
    ``-1`` are every CUDA device (one process elsewhere), a list is its length.

    ``check``: refuse, in one located :class:`RecipeError`, what this machine cannot run (CUDA
    devices that are not there, more CPU processes than :func:`cpu_process_limit`, device indices
    or ``-1`` on the CPU), before any data or model work. Without it (a dry run of a launch line
    meant for another machine), the count the recipe asks for."""
    accelerator, devices = accelerator_of(settings.accelerator), settings.devices
    if accelerator == "cuda":
        return _cuda_count(settings.accelerator, devices, check)
    if accelerator == "cpu":
        return _cpu_count(devices, check)
    if isinstance(devices, list):
        return len(devices)
    return devices if isinstance(devices, int) and devices > 0 else 1


def _cuda_count(accelerator: str, devices: int | list[int] | str, check: bool) -> int:

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if check and available == 0:
        raise RecipeError(f"trainer.accelerator {accelerator}: this machine has no CUDA device; use cpu")
    if devices in ("auto", -1):
        return max(1, available)
    if isinstance(devices, list):
        missing = [i for i in devices if i >= available]
        if check and missing:
            raise RecipeError(f"trainer.devices {devices}: no CUDA device {missing[0]} (this machine has {available})")
        return len(devices)
    if check and devices > available:
        raise RecipeError(
            f"trainer.devices {devices}: this machine has {available} CUDA device{'s' if available != 1 else ''}"
        )
    return devices


def _cpu_count(devices: int | list[int] | str, check: bool) -> int:
    if devices == "auto":
        return 1
    if isinstance(devices, list) or devices == -1:
        if check:
            raise RecipeError(
                f"trainer.devices {devices}: on the CPU each device is a process; give their number (or auto: one)"
            )
        return len(devices) if isinstance(devices, list) else 1
    limit = cpu_process_limit()
    if check and devices > limit:
        raise RecipeError(
            f"trainer.devices {devices}: on the CPU each device is a process; this machine "
            f"has {os.cpu_count() or 1} cores, so at most {limit}"
        )
    return devices


# -- the layout -----------------------------------------------------------------------------------


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
            pipeline_parallel=settings.pipeline_parallel,
            context_parallel=settings.context_parallel,
            expert_parallel=settings.expert_parallel,
        )
    except LayoutError as exc:
        raise RecipeError(f"trainer.{exc.argument} {exc.value}: {exc.reason}") from None


def data_parallel_ranks(settings: TrainerSection, check: bool = True) -> int:
    """Ranks of the recipe's layout that read different data (under ``strategy: fsdp`` the world
    over the tensor-, context- and pipeline-parallel degrees: their peers read the same); ``check`` as for
    :func:`device_count`."""
    per_node = device_count(settings, check=check)
    if settings.strategy == "fsdp":
        return layout_of(settings, per_node).data_parallel_size
    return per_node * settings.num_nodes


def data_parallel_size(trainer) -> int:
    """Ranks of a running Lightning ``trainer`` that read different data (the world, or the world
    over the tensor-, context- and pipeline-parallel degrees)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size))


def data_parallel_rank(trainer) -> int:
    """This rank's place among those that read different data (tensor-parallel peers share one)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", trainer.global_rank))
