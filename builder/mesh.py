"""The device layout a recipe trains on, and how ranks are numbered on its mesh (torch-free).

A :class:`Layout` is ``devices`` ranks on ``nodes`` machines, ``tensor_parallel`` ranks inside a
node splitting each layer, ``pipeline_parallel`` stages holding consecutive layers,
``context_parallel`` ranks splitting each sequence, ``expert_parallel`` ranks splitting a mixture
of experts' experts (borrowed from the FSDP shard group), the rest data-parallel (``shard``,
``hybrid`` or ``replicate``), or with ``strategy="ddp"`` every rank a whole replica. Ranks are
numbered as ``init_device_mesh(("pp", "replicate", "shard", "cp", "tp"))`` lays them out
(:meth:`Layout.mesh`). What a layout cannot split of a spec is
``yamlformer.builder.analysis.layout_rules``'s; what each rank holds,
``yamlformer.builder.analysis.shards``'s; ``yamlformer.builder.analysis.layout`` gathers the three.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DATA_PARALLEL = ("shard", "hybrid", "replicate")
#: how data-parallel ranks hold the model: ``ddp`` a whole replica each, ``fsdp`` (FSDP2) sharded
STRATEGIES = ("ddp", "fsdp")


class LayoutError(ValueError):
    """A layout that cannot run: ``argument`` (``"tensor_parallel"``) set to ``value`` is at fault
    for ``reason``; the message reads ``tensor_parallel=3: reason``."""

    def __init__(self, argument: str, value: Any, reason: str):
        self.argument, self.value, self.reason = argument, value, reason
        super().__init__(f"{argument}={value!r}: {reason}")


@dataclass(frozen=True)
class Layout:
    """``devices`` ranks in all (the world size) on ``nodes`` machines; ``strategy="ddp"`` takes
    no tensor, pipeline, context or expert parallelism and replicates (``data_parallel`` reads
    ``replicate``)."""

    devices: int = 1
    nodes: int = 1
    tensor_parallel: int = 1
    data_parallel: str = "shard"
    strategy: str = "fsdp"
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise LayoutError("strategy", self.strategy, f"must be one of {', '.join(STRATEGIES)}")
        for name in DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(name, value, "must be a positive integer")
        if self.devices % self.nodes:
            raise LayoutError("devices", self.devices, f"must be a multiple of the {self.nodes} nodes")
        if self.data_parallel not in DATA_PARALLEL:
            raise LayoutError("data_parallel", self.data_parallel, f"must be one of {', '.join(DATA_PARALLEL)}")
        if self.strategy == "ddp":
            for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
                if getattr(self, name) != 1:
                    raise LayoutError(name, getattr(self, name), "needs strategy fsdp (DDP replicates whole layers)")
            if self.data_parallel == "hybrid":
                raise LayoutError(
                    "data_parallel", self.data_parallel, "needs strategy fsdp (DDP replicates the whole model)"
                )
            object.__setattr__(self, "data_parallel", "replicate")  # the default "shard" too: DDP shards nothing
        if self.per_node % self.tensor_parallel:
            raise LayoutError(
                "tensor_parallel",
                self.tensor_parallel,
                f"must divide the {self.per_node} devices of a node (tensor parallelism stays inside a node)",
            )
        model = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if self.devices % model:
            raise LayoutError(
                "devices",
                self.devices,
                f"must be a multiple of tensor x pipeline x context parallel = {self.tensor_parallel} x "
                f"{self.pipeline_parallel} x {self.context_parallel} = {model}",
            )
        if self.data_parallel == "hybrid":
            if self.nodes < 2:
                raise LayoutError(
                    "data_parallel",
                    self.data_parallel,
                    "shards inside a node and replicates across nodes, so it needs at least 2 nodes; use shard "
                    "on one node",
                )
            inner = self.tensor_parallel * self.context_parallel
            if self.per_node % inner or self.data_parallel_size % max(1, self.per_node // inner):
                raise LayoutError(
                    "data_parallel",
                    self.data_parallel,
                    f"shards over a node's {self.per_node} devices, which tensor x context parallel "
                    f"{self.tensor_parallel} x {self.context_parallel} must divide, into "
                    f"{self.data_parallel_size} data-parallel ranks",
                )
        if self.shard_size % self.expert_parallel:
            raise LayoutError(
                "expert_parallel",
                self.expert_parallel,
                f"must divide the FSDP shard group of {self.shard_size} ranks (data-parallel shard x "
                "context parallel) it borrows its ranks from",
            )

    @property
    def per_node(self) -> int:
        return self.devices // self.nodes

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: devices / (tensor x pipeline x context parallel)."""
        return self.devices // (self.tensor_parallel * self.pipeline_parallel * self.context_parallel)

    @property
    def data_parallel_shard(self) -> int:
        """Data-parallel ranks in one FSDP shard group (the context-parallel ranks not counted)."""
        if self.data_parallel == "shard":
            return self.data_parallel_size
        if self.data_parallel == "hybrid":
            return max(1, self.per_node // (self.tensor_parallel * self.context_parallel))
        return 1

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over (the FSDP shard group: data-parallel shard x context parallel)."""
        return self.data_parallel_shard * self.context_parallel

    @property
    def replicas(self) -> int:
        return self.data_parallel_size // self.data_parallel_shard

    @property
    def stage_devices(self) -> int:
        """Ranks of one pipeline stage."""
        return self.devices // self.pipeline_parallel

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(replica, shard rank, tensor-parallel rank)`` of a global rank within its pipeline
        stage; the shard rank counts the context-parallel ranks of the FSDP group too."""
        if not 0 <= rank < self.devices:
            raise LayoutError("rank", rank, f"must be in 0..{self.devices - 1}")
        tp, local = self.tensor_parallel, rank % self.stage_devices
        return local // (self.shard_size * tp), local // tp % self.shard_size, local % tp

    def mesh(self, rank: int) -> dict[str, int]:
        """Every coordinate of a global rank: ``pp``, ``replicate``, ``shard``, ``cp``, ``tp``."""
        replica, shard, tp = self.coordinates(rank)
        return {
            "pp": rank // self.stage_devices,
            "replicate": replica,
            "shard": shard // self.context_parallel,
            "cp": shard % self.context_parallel,
            "tp": tp,
        }

    def smallest_rank(self) -> int:
        """A rank holding the fewest elements: the last of the first shard group."""
        return (self.shard_size - 1) * self.tensor_parallel

    def describe(self) -> str:
        """``64 devices on 8 nodes: tensor-parallel 8 x FSDP shard over 8`` and the like."""
        where = f"{self.devices} device{'s' if self.devices > 1 else ''}" + (
            f" on {self.nodes} nodes" if self.nodes > 1 else ""
        )
        parts = [f"tensor-parallel {self.tensor_parallel}"] if self.tensor_parallel > 1 else []
        for name, degree in (
            ("pipeline-parallel", self.pipeline_parallel),
            ("context-parallel", self.context_parallel),
            ("expert-parallel", self.expert_parallel),
        ):
            if degree > 1:
                parts.append(f"{name} {degree}")
        if self.data_parallel == "hybrid":
            parts.append(f"HSDP: FSDP shard over {self.shard_size} x {self.replicas} replicas")
        elif self.data_parallel == "shard" and self.shard_size > 1:
            parts.append(f"FSDP shard over {self.shard_size}")
        elif self.data_parallel_size > 1:
            parts.append(f"{self.data_parallel_size} replicas")
        return f"{where}: {' x '.join(parts) or 'one replica'}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        """The layout :meth:`to_dict` wrote (a field it lacks takes its default)."""
        return cls(**{field.name: data[field.name] for field in dataclasses.fields(cls) if field.name in data})

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "per_node": self.per_node,
            "data_parallel_size": self.data_parallel_size,
            "shard_size": self.shard_size,
            "replicas": self.replicas,
        }

    @property
    def five_d(self) -> bool:
        """Pipeline, context or expert parallelism: sized per stage by ``yamlformer.builder.analysis.perf``."""
        return max(self.pipeline_parallel, self.context_parallel, self.expert_parallel) > 1


#: the degree fields of a layout, as the command-line options name them (``--pipeline-parallel``)
DEGREES = ("devices", "nodes", "tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")
