"""What each rank holds of the model under FSDP2, tensor and expert parallelism, exactly (torch-free).

Of every parameter tensor ``build_model`` creates (``yamlformer.builder.tensors.model_tensors``,
from the blocks' ``param_shapes`` and ``parallel_plan``): the rows ``torch.chunk`` gives each rank
of a shard group (:func:`chunk_rows`), and the bytes one rank keeps (:func:`rank_states`,
:func:`sharded_memory`); the conventions are ``yamlformer.builder.analysis.layout``'s docstring.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from yamlformer.builder.analysis.layout_rules import check_tensor_parallel
from yamlformer.builder.analysis.memory import BYTES
from yamlformer.builder.mesh import Layout, LayoutError
from yamlformer.builder.optim import optimizer_state_bytes
from yamlformer.builder.tensors import FP32, ParamTensor, model_tensors


def chunk_rows(rows: int, parts: int, index: int) -> int:
    """Rows of part ``index`` when ``torch.chunk`` splits ``rows`` into ``parts`` (0 past the end)."""
    size = -(-rows // parts)
    return max(0, min(size, rows - index * size))


# -- what a rank holds ----------------------------------------------------------------------------


def state_groups(held) -> list[tuple[int, str | None, int, int]]:
    """``(elements held, ParamTensor)`` pairs as :func:`yamlformer.builder.optim.optimizer_state_bytes`
    takes them: summed by role and ndim, with their tensor counts."""
    groups: dict[tuple[str | None, int], list[int]] = {}
    for elements, tensor in held:
        entry = groups.setdefault((tensor.cls.role if tensor.cls else None, len(tensor.shape)), [0, 0])
        entry[0] += elements
        entry[1] += 1
    return [(elements, role, ndim, count) for (role, ndim), (elements, count) in groups.items()]


def optimizer_bytes(spec, optimizer=None, tensors: list[ParamTensor] | None = None) -> int:
    """The optimizer's state for the whole model (every trainable tensor on one device), as it declares it
    (``optimizer``: a registered config or type name; None: AdamW)."""
    tensors = model_tensors(spec) if tensors is None else tensors
    trained = (t for t in tensors if t.trains)  # a frozen base parameter (adapters) has no state
    return optimizer_state_bytes(state_groups((_numel(t.shape), t) for t in trained), optimizer)


def element_groups(spec) -> list[tuple[int, str | None, int, int]]:
    """The model's parameter elements by role and ndim, as
    :func:`yamlformer.builder.optim.optimizer_state_bytes` takes them, without tensor counts (the
    performance model counts elements per layer: a per-tensor state, AdamW's step, is left out, as
    it always has been)."""
    held = state_groups((_numel(t.shape), t) for t in model_tensors(spec) if t.trains)
    return [(elements, role, ndim, 0) for elements, role, ndim, _ in held]


def mean_optimizer_bytes(spec, optimizer=None, groups: list | None = None) -> float:
    """The optimizer's state per parameter element, averaged over the whole model (``groups``: the
    spec's :func:`element_groups`, when already read)."""
    groups = element_groups(spec) if groups is None else groups
    return optimizer_state_bytes(groups, optimizer) / max(1, sum(elements for elements, *_ in groups))


@dataclass(frozen=True)
class RankStates:
    """What one rank holds of the model's persistent training state, exactly.

    ``elements``: the local shards' elements (``sum(p.to_local().numel())``); ``weights``,
    ``gradients``: their bytes (fp32); ``optimizer``: the optimizer's state for them, as it
    declares it (``yamlformer.builder.optim.optimizer_state_bytes``; AdamW: two fp32 states per element
    and an fp32 step per tensor); ``padded_elements``: what FSDP2 allocates per rank for the
    parameters (and the flat gradient buffers), rank 0's share on every rank of the group. Under a
    spec's ``adapters`` only the ``trainable_elements`` of ``trainable_tensors`` have gradients and
    optimizer state; the frozen rest keeps ``frozen_bytes`` of weights (an NF4 base at its real bytes).
    """

    rank: int
    shard_rank: int
    tensors: int
    elements: int
    padded_elements: int
    optimizer: int
    trainable_elements: int | None = None  # None: every element trains
    trainable_tensors: int | None = None
    frozen_bytes: int = 0

    @property
    def _trains(self) -> tuple[int, int]:
        if self.trainable_elements is None:
            return self.elements, self.tensors
        return self.trainable_elements, self.trainable_tensors

    @property
    def weights(self) -> int:
        return self._trains[0] * FP32 + self.frozen_bytes

    @property
    def gradients(self) -> int:
        return self._trains[0] * FP32

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "weights": self.weights,
            "gradients": self.gradients,
        }


def rank_states(
    spec, layout: Layout, rank: int = 0, tensors: list[ParamTensor] | None = None, optimizer=None
) -> RankStates:
    """The parameters, gradients and optimizer state (``optimizer``: a registered optimizer's config
    or type name; None: AdamW) global ``rank`` holds under ``layout``. Under expert parallelism
    (``E`` ranks) a stacked expert tensor keeps its ``n / E`` experts' rows (``E`` divides ``n``:
    :func:`expert_parallel_problems`), which FSDP2 then chunks over the ``shard_size / E`` ranks of
    the shard group holding the same experts."""
    check_tensor_parallel(spec, layout.tensor_parallel)
    tensors = model_tensors(spec) if tensors is None else tensors
    _, shard, _ = layout.coordinates(rank)
    group, tp, ep = layout.shard_size, layout.tensor_parallel, layout.expert_parallel
    # (local shape, rows split over, role, trains, bytes) -> tensors: a few distinct kinds
    kinds = Counter(
        (
            tensor.local_shape(tp),
            ep if tensor.expert and ep > 1 else 1,
            tensor.cls.role if tensor.cls else None,
            tensor.trains,
            tensor.bytes_per_element,
        )
        for tensor in tensors
    )
    elements = padded = trainable = frozen_bytes = 0
    states = []
    for (shape, split, role, trains, size), count in kinds.items():
        rest = _numel(shape[1:]) * count
        rows, parts, part = shape[0] // split, group // split, shard // split
        held = chunk_rows(rows, parts, part) * rest
        elements += held
        padded += chunk_rows(rows, parts, 0) * rest
        if trains:  # a frozen tensor has no optimizer state
            trainable += held
            states.append((held, role, len(shape), count))
        else:
            frozen_bytes += round(held * size)
    tuned = trainable != elements
    return RankStates(
        rank=rank,
        shard_rank=shard,
        tensors=len(tensors),
        elements=elements,
        padded_elements=padded,
        optimizer=optimizer_state_bytes(states, optimizer),
        trainable_elements=trainable if tuned else None,
        trainable_tensors=sum(t.trains for t in tensors) if tuned else None,
        frozen_bytes=frozen_bytes,
    )


def unit_sizes(tensors: list[ParamTensor], tp: int) -> dict[str, int]:
    """Elements of each FSDP unit, unsharded, as one tensor-parallel rank gathers it."""
    sizes: dict[str, int] = {}
    for tensor in tensors:
        sizes[tensor.unit] = sizes.get(tensor.unit, 0) + _numel(tensor.local_shape(tp))
    return sizes


def sharded_memory(spec, layout: Layout, per_rank, optimizer=None):
    """``per_rank`` (the memory estimate of :func:`tensor_parallel_spec`'s spec on one device)
    with its weights, gradients, optimizer state and sharding buffers replaced by what rank 0 —
    the rank holding the most — holds under ``layout`` (expert parallelism counted exactly, as
    :func:`rank_states` counts it). A layout with pipeline or context parallelism is refused,
    naming the degree: ``yamlformer.builder.analysis.perf.memory`` sizes those per stage (``builder describe
    --pipeline-parallel`` prints it), not tensor by tensor."""
    if max(layout.pipeline_parallel, layout.context_parallel) > 1:
        name = next(n for n in ("pipeline_parallel", "context_parallel") if getattr(layout, n) > 1)
        raise LayoutError(
            name,
            getattr(layout, name),
            "the exact per-rank accounting covers tensor parallel x FSDP; yamlformer.builder.analysis.perf sizes this "
            "layout per stage (builder describe --pipeline-parallel/--context-parallel/--expert-parallel)",
        )
    tensors = model_tensors(spec)
    largest, smallest = (rank_states(spec, layout, r, tensors, optimizer) for r in (0, layout.smallest_rank()))
    compute = BYTES[per_rank.dtype]
    biggest_unit = max(unit_sizes(tensors, layout.tensor_parallel).values(), default=0)
    # two gathered units (computing, prefetched); the unit's unsharded gradients and their fp32
    # reduce-scatter input
    buffers = biggest_unit * (3 * compute + FP32)
    info = {
        **layout.to_dict(),
        "rank": 0,
        "largest": largest.to_dict(),
        "smallest": smallest.to_dict(),
        "largest_unit": biggest_unit,
    }
    local = sum(_numel(t.local_shape(layout.tensor_parallel)) for t in tensors)  # one TP rank, unsharded
    return dataclasses.replace(
        per_rank,
        devices=layout.devices,
        strategy="fsdp",
        weights=largest.weights,
        master_weights=0,
        gradients=largest.gradients,
        optimizer=largest.optimizer,
        sharding_buffers=buffers,
        layout=info,
        inference_weights=local * compute,
    )


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """The layers of each pipeline stage, consecutive; where they do not divide, the extra layers
    go to the middle stages first, then the first, so the first (the embedding) and the last (the
    final norm and the head's projection) hold fewer. The recipes cut a model so
    (``yamlformer.recipes.parallel.pipeline``), and the performance model counts stages so."""
    base, extra = divmod(n_layers, n_stages)
    order = sorted(range(n_stages), key=lambda s: (s == n_stages - 1, s == 0))  # middle, first, last
    counts = [base + (s in order[:extra]) for s in range(n_stages)]
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [list(range(start, start + count)) for start, count in zip(starts, counts)]


def stages_of_rank(rank: int, ranks: int, per_rank: int, style: str) -> list[int]:
    """The stage indices pipeline rank ``rank`` of ``ranks`` holds: ``loop`` (rank r: stages r,
    r + P, ...) or ``v`` (rank r: stages r and 2P - 1 - r)."""
    if style == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + i * ranks for i in range(per_rank)]


def stage_tensors(
    spec, stages: list[int], n_stages: int, tensors: list[ParamTensor] | None = None
) -> list[ParamTensor]:
    """The parameter tensors (:func:`model_tensors`) a pipeline rank holding ``stages`` of
    ``n_stages`` keeps: their layers, the embedding with the first stage, the final norm and the
    head with the last (a decoder-only spec: pipelines cut its one stack)."""
    ((stack, config),) = spec.stacks().items()
    cut = stage_layers(config.n_layers, n_stages)
    units = {f"{stack}.layers.{i}" for s in stages for i in cut[s]}
    units |= {f"{stack}.embedding"} if 0 in stages else set()
    units |= {"head", "root"} if n_stages - 1 in stages else set()
    # the first stage's table even when a tied head puts it in the root unit (the last stage keeps a copy)
    table = f"{stack}.embedding." if 0 in stages else None
    held = model_tensors(spec) if tensors is None else tensors
    return [t for t in held if t.unit in units or (table is not None and t.name.startswith(table))]


def pipeline_rank_states(
    spec, layout: Layout, per_rank: int = 1, style: str = "loop", optimizer=None
) -> list[RankStates]:
    """:func:`rank_states` of the first rank of each pipeline rank's group (its stages' tensors
    only; ``per_rank`` stages each, placed by ``style``), exactly as the recipes hold them."""
    tensors, pp = model_tensors(spec), layout.pipeline_parallel
    out = []
    for p in range(pp):
        rank = p * layout.stage_devices  # pp is the mesh's outermost dimension
        mine = stage_tensors(spec, stages_of_rank(p, pp, per_rank, style), pp * per_rank, tensors)
        out.append(rank_states(spec, layout, rank, mine, optimizer))
    return out
