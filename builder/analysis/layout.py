"""Where every parameter lives under FSDP2 and tensor parallelism, exactly, per rank (torch-free).

A :class:`Layout` is the device mesh a recipe trains on: ``devices`` ranks on ``nodes``
machines, ``tensor_parallel`` ranks inside a node splitting each layer, ``pipeline_parallel``
stages holding consecutive layers, ``context_parallel`` ranks splitting each sequence (ring
attention), ``expert_parallel`` ranks splitting a mixture of experts' experts (borrowed from the
FSDP shard group, as torchtitan borrows them), the rest data-parallel —
``shard`` (FSDP2 full sharding over every data-parallel rank), ``hybrid`` (HSDP: shard inside a
node, replicate across nodes) or ``replicate`` — or, with ``strategy="ddp"``, every rank a
whole replica (DDP). Each parallelism is one field of it. Ranks are numbered as
``init_device_mesh(("pp", "replicate", "shard", "cp", "tp"))`` lays them out: tensor-parallel
ranks innermost (neighbours on one node), then context-parallel ranks, then the shard group,
then the replicas, then the pipeline stages. FSDP shards over the shard group and the
context-parallel ranks together (``shard_size``). :func:`layout_problems` names every field of a
spec (or the step's sequence) a layout cannot split; the rank accounting below
(:func:`rank_states`, :func:`sharded_memory`; expert parallelism counted exactly) is for layouts
without pipeline or context parallelism, which ``builder.analysis.perf`` sizes per stage.

What a rank holds, as PyTorch builds it:

* **Tensor parallelism** (DTensor). Each block declares ``parallel_plan()`` in its config
  (``blocks/configs``): ``colwise`` shards a Linear's weight and bias on dim 0, ``rowwise`` its
  weight on dim 1 (the bias replicated), ``vocab`` a vocabulary table or projection on dim 0
  (outputs whole); the rest is replicated. The token embedding is vocab-parallel; the head's
  projection splits the vocabulary and its logits are gathered whole (``recipes.parallel.tensor``).
  Every split must be even: heads, KV heads, FFN width and vocabulary divide by the degree, or
  :func:`tensor_parallel_problems` names the field.
* **FSDP2** (``fully_shard``, one unit per Transformer layer, one per embedding, one for the head
  and the root for the rest, a tied head and its embedding among them) shards every parameter —
  the tensor-parallel local tensor under TP —
  on dim 0 over the shard group as ``torch.chunk`` splits it: rank ``s`` of the group holds rows
  ``[s*c, (s+1)*c)`` of ``c = ceil(rows / group)``, so later ranks can hold fewer rows or none.
  Shard rank 0 holds the most, the last the least. FSDP2 pads each rank's parameter storage (and
  its flat gradient buffer) to rank 0's size.
* **Mixed precision** (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): the
  sharded parameters stay fp32 and are the optimizer's master weights (no second copy); each unit
  is all-gathered in bf16 for compute; its gradients are reduce-scattered in fp32 into fp32
  sharded gradients. AdamW keeps ``exp_avg`` and ``exp_avg_sq`` (fp32, the local shard's shape)
  and a 4-byte ``step`` per parameter tensor. So a rank holds 16 bytes per local element plus 4
  per tensor, in bf16, fp16 and fp32 alike.
* **Transient** (an estimate, not exact): two units' gathered parameters (the one computing and
  the one prefetched) in the compute dtype, and the largest unit's unsharded gradients in the
  compute dtype plus their fp32 reduce-scatter input.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from blocks.configs.base import PARALLEL_STYLES, indivisible
from builder.analysis.memory import BYTES

DATA_PARALLEL = ("shard", "hybrid", "replicate")
#: how data-parallel ranks hold the model: ``ddp`` a whole replica each, ``fsdp`` (FSDP2) sharded
STRATEGIES = ("ddp", "fsdp")
FP32 = 4
ADAMW_STATES = 2  # exp_avg, exp_avg_sq
ADAMW_STEP = 4  # one fp32 scalar per parameter tensor
#: the token embedding's plan: a vocabulary-parallel table (torch's RowwiseParallel on nn.Embedding)
EMBEDDING_PLAN = {"tokens": "vocab"}
#: the layer fields that hold blocks, as ``builder.spec.schema.LAYER_FIELDS``
_LAYER_BLOCKS = ("attention", "cross_attention", "ffn", "norm")


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
        """Pipeline, context or expert parallelism: sized per stage by ``builder.analysis.perf``."""
        return max(self.pipeline_parallel, self.context_parallel, self.expert_parallel) > 1


#: the degree fields of a layout, as the command-line options name them (``--pipeline-parallel``)
DEGREES = ("devices", "nodes", "tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")


def experts_of(ffn) -> tuple[int, int] | None:
    """``(n_experts, top_k)`` of a feed-forward block that routes tokens to experts (its
    ``n_experts`` and ``top_k`` fields), None for a dense one."""
    n = getattr(ffn, "n_experts", None)
    return (n, ffn.top_k) if n else None


def layout_problems(spec, layout: Layout, seq_len: int | None = None) -> list[LayoutError]:
    """Every way ``layout`` cannot split ``spec`` (and ``seq_len``), each naming the argument at
    fault and the spec field: a tensor-parallel degree a head count does not divide, more
    pipeline stages than layers, an expert-parallel degree the experts do not divide (or a
    model without experts), a sequence the context-parallel ranks cannot split in balanced halves."""
    out = []
    problems = tensor_parallel_problems(spec, layout.tensor_parallel)
    if problems:
        out.append(
            LayoutError(
                "tensor_parallel",
                layout.tensor_parallel,
                "; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems),
            )
        )
    stacks = spec.stacks()
    if max(layout.pipeline_parallel, layout.context_parallel) > 1 and len(stacks) > 1:
        name = "pipeline_parallel" if layout.pipeline_parallel > 1 else "context_parallel"
        out.append(LayoutError(name, getattr(layout, name), f"splits one stack; {spec.name} has {', '.join(stacks)}"))
    layers = sum(stack.n_layers for stack in stacks.values())
    if layout.pipeline_parallel > layers:
        first = next(iter(stacks))
        out.append(
            LayoutError(
                "pipeline_parallel",
                layout.pipeline_parallel,
                f"{first}.n_layers ({layers}): more stages than layers",
            )
        )
    if layout.expert_parallel > 1:
        routed = [
            (f"{name}.{where}ffn.n_experts", experts_of(ffn))
            for name, stack in stacks.items()
            for where, ffn in [("", stack.ffn), *((f"overrides.{i}.", o.ffn) for i, o in enumerate(stack.overrides))]
            if ffn is not None and experts_of(ffn)
        ]
        if not routed:
            out.append(LayoutError("expert_parallel", layout.expert_parallel, f"{spec.name} has no experts to split"))
        for path, (n, _) in routed:
            if n % layout.expert_parallel:
                out.append(
                    LayoutError("expert_parallel", layout.expert_parallel, f"{path} ({n}) does not divide by it")
                )
    if layout.context_parallel > 1 and seq_len is not None and seq_len % (2 * layout.context_parallel):
        out.append(
            LayoutError(
                "context_parallel",
                layout.context_parallel,
                f"seq_len {seq_len} does not split into 2 x {layout.context_parallel} equal chunks "
                "(load-balanced causal ring attention)",
            )
        )
    return out


def check_layout(spec, layout: Layout, seq_len: int | None = None) -> None:
    """Raise the first of :func:`layout_problems`."""
    problems = layout_problems(spec, layout, seq_len)
    if problems:
        raise problems[0]


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of the built model (a tied or shared tensor once, by its first name)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim tensor parallelism splits; None: replicated on every TP rank
    unit: str  # its FSDP unit: "decoder.layers.3", "decoder.embedding", "head" or "root"
    expert: bool = False  # stacked routed experts, split on dim 0 over the expert-parallel ranks

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
    d, vocab = spec.d_model, spec.vocab_size
    tensors: dict[str, ParamTensor] = {}

    def add(prefix: str, config, shapes: dict, unit: str, plan: dict | None = None) -> None:
        plan = (config.parallel_plan() or {}) if plan is None else plan
        for name, shape in shapes.items():
            full = prefix + name
            tensors[full] = ParamTensor(full, tuple(shape), _tp_dim(plan, name, shape, full), unit)

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
                add(f"{name}.embedding.norm.", norm, _shapes(norm, "embedding.norm", d), unit)
        add(
            f"{name}.position.",
            spec.position,
            _shapes(spec.position, "position", d, stack.attention.query_heads(), spec.max_seq_len),
            "root",
        )
        walked: dict[int, list[tuple[str, tuple[int, ...], int | None]]] = {}  # per distinct layer
        for index, layer in enumerate(stack.layers()):
            unit = f"{name}.layers.{index}"
            if id(layer) not in walked:  # identical layers share one config: walk its blocks once
                walked[id(layer)] = _layer_tensors(layer, name, name in architecture.memory_of, d)
            for suffix, shape, dim, expert in walked[id(layer)]:
                full = f"{unit}.{suffix}"
                tensors[full] = ParamTensor(full, shape, dim, unit, expert)
        if stack.final_norm:
            add(f"{name}.final_norm.", stack.norm, _shapes(stack.norm, f"{name}.norm", d), "root")
    add("head.", spec.head, _shapes(spec.head, "head", d, vocab, tied), "root" if tied else "head")
    return list(tensors.values())


def layer_tensor_count(spec) -> int:
    """Parameter tensors of every layer of every stack, counted per group of identical layers
    (so instant for any number of layers)."""
    architecture = spec.architecture_config
    return sum(
        len(indices) * len(_layer_tensors(layer, name, name in architecture.memory_of, spec.d_model))
        for name, stack in spec.stacks().items()
        for indices, layer in stack.layer_groups()
    )


def _layer_tensors(layer, stack: str, cross: bool, d: int) -> list[tuple[str, tuple[int, ...], int | None, bool]]:
    """``(name within the layer, shape, tensor-parallel dim, split by expert parallelism)`` of
    each parameter of one layer."""
    out = []

    def add(prefix: str, block, where: str) -> None:
        plan = block.parallel_plan() or {}
        experts = tuple(f"{m}." for m in getattr(block, "expert_parallel_plan", tuple)())
        for name, shape in _shapes(block, where, d).items():
            dim = _tp_dim(plan, name, shape, f"{stack}.layers.N.{prefix}{name}")
            out.append((prefix + name, tuple(shape), dim, name.startswith(experts) if experts else False))

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
    module = name.rpartition(".")[0]
    keys = [k for k in plan if module == k or module.startswith(k + ".")]
    style = plan[max(keys, key=len)] if keys else "replicate"
    if style not in PARALLEL_STYLES:
        raise LayoutError(
            "spec", full, f"unknown tensor-parallel style {style!r}; styles are {', '.join(PARALLEL_STYLES)}"
        )
    if style in ("colwise", "vocab"):
        return 0
    if style == "rowwise":
        return 1 if len(shape) == 2 else None
    return None


# -- tensor parallelism over the spec ------------------------------------------------------------


def _blocks(spec):
    """(location, config) of every block config in the spec, in the spec's field order."""
    if spec.embedding.norm is not None:
        yield ("embedding", "norm"), spec.embedding.norm
    yield ("position",), spec.position
    for name, stack in spec.stacks().items():
        for key in _LAYER_BLOCKS:
            if getattr(stack, key) is not None:
                yield (name, key), getattr(stack, key)
        for i, override in enumerate(stack.overrides):
            for key in _LAYER_BLOCKS:
                if getattr(override, key, None) is not None:
                    yield (name, "overrides", i, key), getattr(override, key)
    yield ("head",), spec.head


def tensor_parallel_problems(spec, tp: int) -> list[tuple[tuple, str]]:
    """``(field path, message)`` for every field that does not divide by ``tp``."""
    if tp == 1:
        return []
    problems = [
        (loc, f"{message} (the embedding and head are vocab-parallel)")
        for loc, message in indivisible(tp, vocab_size=spec.vocab_size)
    ]
    for loc, config in _blocks(spec):
        problems += [(loc + where, message) for where, message in config.tensor_parallel_problems(tp, spec.d_model)]
    return problems


def expert_parallel_problems(spec, ep: int) -> list[tuple[tuple, str]]:
    """``(field path, message)`` for every block whose experts ``ep`` ranks cannot split as the
    recipes run it (each block's ``expert_parallel_problems``: an expert count the degree does
    not divide, a block that keeps its experts as separate modules), or the first stack's ``ffn``
    when no block routes to experts. :func:`layout_problems` asks less: what any EP could split."""
    if ep == 1:
        return []
    problems, routed = [], False
    for loc, config in _blocks(spec):
        if experts_of(config):
            routed = True
            problems += [(loc + where, message) for where, message in config.expert_parallel_problems(ep)]
    if not routed:
        problems.append(
            ((next(iter(spec.stacks())), "ffn"), f"{spec.name} has no experts for expert parallelism to split")
        )
    return problems


def check_tensor_parallel(spec, tp: int) -> None:
    """Raise :class:`LayoutError` (argument ``tensor_parallel``) naming each field that does not divide."""
    problems = tensor_parallel_problems(spec, tp)
    if problems:
        raise LayoutError(
            "tensor_parallel", tp, "; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems)
        )


def tensor_parallel_spec(spec, tp: int):
    """The spec as one of ``tp`` tensor-parallel ranks runs it: every block replaced by its
    ``tensor_parallel`` view, so that estimating it gives one rank's FLOPs, activations and KV
    cache. No sequence parallelism: each layer's input, the norms and the dropout masks stay whole
    on every rank; the vocabulary stays whole too, as the head's gathered logits are (its
    parameter count is then not one rank's: :func:`rank_states` counts those)."""
    if tp == 1:
        return spec
    check_tensor_parallel(spec, tp)
    d = spec.d_model

    def view(config):
        return config.tensor_parallel(tp, d) if config is not None else None

    def view_blocks(section):
        return section.model_copy(
            update={k: view(getattr(section, k)) for k in _LAYER_BLOCKS if getattr(section, k, None) is not None}
        )

    update: dict[str, Any] = {}
    for name, stack in spec.stacks().items():
        local = view_blocks(stack)
        update[name] = local.model_copy(update={"overrides": [view_blocks(o) for o in stack.overrides]})
    embedding = spec.embedding.model_copy(update={"norm": view(spec.embedding.norm)})
    return spec.model_copy(
        update={**update, "embedding": embedding, "position": view(spec.position), "head": view(spec.head)}
    )


# -- what a rank holds ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RankStates:
    """What one rank holds of the model's persistent training state, exactly.

    ``elements``: the local shards' elements (``sum(p.to_local().numel())``); ``weights``,
    ``gradients``, ``optimizer``: their bytes (fp32; AdamW's two states plus one fp32 step per
    tensor); ``padded_elements``: what FSDP2 allocates per rank for the parameters (and the flat
    gradient buffers), rank 0's share on every rank of the group.
    """

    rank: int
    shard_rank: int
    tensors: int
    elements: int
    padded_elements: int

    @property
    def weights(self) -> int:
        return self.elements * FP32

    @property
    def gradients(self) -> int:
        return self.elements * FP32

    @property
    def optimizer(self) -> int:
        return self.elements * FP32 * ADAMW_STATES + self.tensors * ADAMW_STEP

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
        }


def rank_states(spec, layout: Layout, rank: int = 0, tensors: list[ParamTensor] | None = None) -> RankStates:
    """The parameters, gradients and AdamW states global ``rank`` holds under ``layout``. Under
    expert parallelism (``E`` ranks) a stacked expert tensor keeps its ``n / E`` experts' rows
    (``E`` divides ``n``: :func:`expert_parallel_problems`), which FSDP2 then chunks over the
    ``shard_size / E`` ranks of the shard group holding the same experts."""
    check_tensor_parallel(spec, layout.tensor_parallel)
    tensors = model_tensors(spec) if tensors is None else tensors
    _, shard, _ = layout.coordinates(rank)
    group, tp, ep = layout.shard_size, layout.tensor_parallel, layout.expert_parallel
    # (local shape, rows split over, this rank's part) -> tensors: a few distinct shapes
    shapes = Counter((tensor.local_shape(tp), ep if tensor.expert and ep > 1 else 1) for tensor in tensors)
    elements = padded = 0
    for (shape, split), count in shapes.items():
        rest = _numel(shape[1:]) * count
        rows, parts, part = shape[0] // split, group // split, shard // split
        elements += chunk_rows(rows, parts, part) * rest
        padded += chunk_rows(rows, parts, 0) * rest
    return RankStates(rank=rank, shard_rank=shard, tensors=len(tensors), elements=elements, padded_elements=padded)


def unit_sizes(tensors: list[ParamTensor], tp: int) -> dict[str, int]:
    """Elements of each FSDP unit, unsharded, as one tensor-parallel rank gathers it."""
    sizes: dict[str, int] = {}
    for tensor in tensors:
        sizes[tensor.unit] = sizes.get(tensor.unit, 0) + _numel(tensor.local_shape(tp))
    return sizes


def sharded_memory(spec, layout: Layout, per_rank):
    """``per_rank`` (the memory estimate of :func:`tensor_parallel_spec`'s spec on one device)
    with its weights, gradients, optimizer state and sharding buffers replaced by what rank 0 —
    the rank holding the most — holds under ``layout`` (expert parallelism counted exactly, as
    :func:`rank_states` counts it). A layout with pipeline or context parallelism is refused,
    naming the degree: ``builder.analysis.perf.memory`` sizes those per stage (``builder describe
    --pipeline-parallel`` prints it), not tensor by tensor."""
    if max(layout.pipeline_parallel, layout.context_parallel) > 1:
        name = next(n for n in ("pipeline_parallel", "context_parallel") if getattr(layout, n) > 1)
        raise LayoutError(
            name,
            getattr(layout, name),
            "the exact per-rank accounting covers tensor parallel x FSDP; builder.analysis.perf sizes this "
            "layout per stage (builder describe --pipeline-parallel/--context-parallel/--expert-parallel)",
        )
    tensors = model_tensors(spec)
    largest, smallest = (rank_states(spec, layout, r, tensors) for r in (0, layout.smallest_rank()))
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
