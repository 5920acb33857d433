"""What each rank holds of the model under FSDP2, tensor and expert parallelism, exactly (torch-free).

Every parameter tensor ``build_model`` creates (:func:`model_tensors`, from the blocks'
``param_shapes`` and ``parallel_plan``), the rows ``torch.chunk`` gives each rank of a shard
group (:func:`chunk_rows`), and the bytes one rank keeps (:func:`rank_states`,
:func:`sharded_memory`); the conventions are ``yamlformer.builder.analysis.layout``'s docstring.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from yamlformer.blocks.configs.adapters import nf4_bytes
from yamlformer.blocks.configs.base import PARALLEL_STYLES
from yamlformer.blocks.configs.linear import plan_style
from yamlformer.blocks.configs.tensors import TensorClass
from yamlformer.blocks.configs.tensors import table as table_class
from yamlformer.builder.analysis.layout_rules import check_tensor_parallel
from yamlformer.builder.analysis.memory import BYTES
from yamlformer.builder.analysis.mesh import Layout, LayoutError
from yamlformer.builder.spec.adapters import adapted, quantized

FP32 = 4
#: the token embedding's plan: a vocabulary-parallel table (torch's RowwiseParallel on nn.Embedding)
EMBEDDING_PLAN = {"tokens": "vocab"}


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of the built model (a tied or shared tensor once, by its first name)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim tensor parallelism splits; None: replicated on every TP rank
    unit: str  # its FSDP unit: "decoder.layers.3", "decoder.embedding", "head" or "root"
    expert: bool = False  # stacked routed experts, split on dim 0 over the expert-parallel ranks
    cls: TensorClass | None = None  # what its block declares it is (None: the block declares no classes)
    trains: bool = True  # False: a frozen base parameter under a spec's adapters (a weight, no states)
    bytes_per_element: float = FP32  # what one element of the sharded weight keeps (an NF4 base: ~0.52)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one tensor-parallel rank holds (splits are even, see tensor_parallel_problems)."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] //= tp
        return tuple(shape)


def chunk_rows(rows: int, parts: int, index: int) -> int:
    """Rows of part ``index`` when ``torch.chunk`` splits ``rows`` into ``parts`` (0 past the end)."""
    size = -(-rows // parts)
    return max(0, min(size, rows - index * size))


def model_tensors(spec) -> list[ParamTensor]:
    """Every parameter tensor ``build_model(spec)`` creates, named as ``named_parameters()`` names
    it, with the dim tensor parallelism splits and the FSDP unit it belongs to.

    The names come from each block's ``param_shapes`` under the paths assembly gives the blocks
    (``decoder.layers.3.ffn.``); the split from each block's ``parallel_plan``.
    """
    d, vocab = spec.d_model, spec.padded_vocab_size  # the tables and projection hold the padded rows
    tensors: dict[str, ParamTensor] = {}

    def add(prefix: str, config, shapes: dict, unit: str, plan: dict | None = None, dims: tuple = ()) -> None:
        plan = (config.parallel_plan() or {}) if plan is None else plan
        classes = (config.tensor_classes(*dims) if config is not None else dict.fromkeys(shapes, table_class())) or {}
        for name, shape in shapes.items():
            full = prefix + name
            tensors[full] = ParamTensor(
                full, tuple(shape), _tp_dim(plan, name, shape, full), unit, cls=classes.get(name)
            )

    architecture = spec.architecture_config
    stacks = spec.stacks()
    shared = spec.share_encoder_decoder_embeddings  # one embedding module for every stack
    tied = spec.tie_embeddings and type(spec.head).projects_to_vocab
    # a head tied to an embedding shares the root unit with it (one tensor, one unit)
    tied_embedding = (list(stacks)[0] if shared else list(stacks)[-1]) if tied else None
    for position, (name, stack) in enumerate(stacks.items()):
        if position == 0 or not shared:
            unit = f"{name}.embedding" if name != tied_embedding else "root"
            table = {"tokens.weight": (vocab, d)}
            if spec.embedding.segments:
                table["segments.weight"] = (spec.embedding.segments, d)
            add(f"{name}.embedding.", None, table, unit, plan=EMBEDDING_PLAN)
            if spec.embedding.norm is not None:
                norm = spec.embedding.norm
                add(f"{name}.embedding.norm.", norm, _shapes(norm, "embedding.norm", d), unit, dims=(d,))
        position_dims = (d, stack.attention.query_heads(), spec.max_seq_len)
        add(
            f"{name}.position.",
            spec.position,
            _shapes(spec.position, "position", *position_dims),
            "root",
            dims=position_dims,
        )
        walked: dict[int, list[tuple[str, tuple[int, ...], int | None]]] = {}  # per distinct layer
        for index, layer in enumerate(stack.layers()):
            unit = f"{name}.layers.{index}"
            if id(layer) not in walked:  # identical layers share one config: walk its blocks once
                walked[id(layer)] = _layer_tensors(layer, name, name in architecture.memory_of, d)
            for suffix, shape, dim, expert, cls in walked[id(layer)]:
                full = f"{unit}.{suffix}"
                tensors[full] = ParamTensor(full, shape, dim, unit, expert, cls)
        if stack.final_norm:
            add(f"{name}.final_norm.", stack.norm, _shapes(stack.norm, f"{name}.norm", d), "root", dims=(d,))
    head_dims = (d, vocab, tied)
    add("head.", spec.head, _shapes(spec.head, "head", *head_dims), "root" if tied else "head", dims=head_dims)
    if spec.adapters is not None:
        _adapter_tensors(spec, tensors)
    return list(tensors.values())


def _adapter_tensors(spec, tensors: dict[str, ParamTensor]) -> None:
    """Under a spec's ``adapters``: each adapted layer's adapter tensors (in its layer's FSDP unit,
    split by tensor parallelism where its layer is: ``AdapterBlock.tensor_parallel_dim``) and every
    other tensor frozen, an NF4 base at the bytes torchao keeps per element."""
    config = spec.adapters
    frozen = {name: dataclasses.replace(t, trains=False) for name, t in tensors.items()}
    for path, entry in quantized(spec).items():
        weight = frozen[f"{path}.weight"]
        n = entry.layer.out * entry.layer.in_
        frozen[weight.name] = dataclasses.replace(weight, bytes_per_element=nf4_bytes(n, FP32) / n)
    tensors.update(frozen)
    for path, entry in adapted(spec).items():
        base = tensors.get(f"{path}.weight")  # none for a tied head's projection (the embedding's)
        for name, shape in config.param_shapes(entry.layer).items():
            full = f"{path}.adapter.{name}"
            dim = config.tensor_parallel_dim(name, entry.style)
            tensors[full] = ParamTensor(
                full,
                tuple(shape),
                dim % len(shape) if dim is not None else None,
                base.unit if base is not None else "root",
                base.expert if base is not None else False,
            )


def layer_tensor_count(spec) -> int:
    """Parameter tensors of every layer of every stack, counted per group of identical layers
    (so instant for any number of layers)."""
    architecture = spec.architecture_config
    return sum(
        len(indices) * len(_layer_tensors(layer, name, name in architecture.memory_of, spec.d_model))
        for name, stack in spec.stacks().items()
        for indices, layer in stack.layer_groups()
    )


def _layer_tensors(layer, stack: str, cross: bool, d: int) -> list[tuple]:
    """``(name within the layer, shape, tensor-parallel dim, split by expert parallelism, class)``
    of each parameter of one layer."""
    out = []

    def add(prefix: str, block, where: str) -> None:
        plan = block.parallel_plan() or {}
        experts = tuple(f"{m}." for m in getattr(block, "expert_parallel_plan", tuple)())
        classes = block.tensor_classes(d) or {}
        for name, shape in _shapes(block, where, d).items():
            dim = _tp_dim(plan, name, shape, f"{stack}.layers.N.{prefix}{name}")
            expert = name.startswith(experts) if experts else False
            out.append((prefix + name, tuple(shape), dim, expert, classes.get(name)))

    sublayers = layer.sublayers(cross)
    for sub in sublayers:
        add(f"{sub}.", getattr(layer, sub), f"{stack}.{sub}")
    for norm in layer.norm_names(cross):  # the layer's own list (sandwich's second, shared_norm's one)
        add(f"{norm}.", layer.norm, f"{stack}.norm")
    return out


def _shapes(config, where: str, *dims) -> dict[str, tuple[int, ...]]:
    shapes = getattr(config, "param_shapes", None)
    if shapes is None:
        raise LayoutError(
            "spec",
            where,
            f"block {type(config).__qualname__} declares no param_shapes(); "
            "per-rank figures need every parameter's shape",
        )
    return shapes(*dims)


def _tp_dim(plan: dict[str, str], name: str, shape, full: str) -> int | None:
    """The dim the plan's style splits for parameter ``name`` (``q_proj.weight``) of a block."""
    style = plan_style(plan, name.rpartition(".")[0])
    if style not in PARALLEL_STYLES:
        raise LayoutError(
            "spec", full, f"unknown tensor-parallel style {style!r}; styles are {', '.join(PARALLEL_STYLES)}"
        )
    if style in ("colwise", "vocab"):
        return 0
    if style == "rowwise":
        return 1 if len(shape) == 2 else None
    return None


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
    from yamlformer.builder.optim import optimizer_state_bytes

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
    from yamlformer.builder.optim import optimizer_state_bytes

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
    from yamlformer.builder.optim import optimizer_state_bytes

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
