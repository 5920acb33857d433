"""Every parameter tensor ``build_model`` creates, from the blocks' declarations alone (torch-free):
its name as ``named_parameters()`` names it, its shape, the dim tensor parallelism splits, the FSDP
unit it belongs to and the class its block declares (:func:`model_tensors`). Below the spec (whose
parametrization scales these tensors, ``yamlformer.builder.parametrization``) and the analysis
(which counts what each rank holds of them, ``yamlformer.builder.analysis.shards``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from yamlformer.blocks.configs.adapters import nf4_bytes
from yamlformer.blocks.configs.base import PARALLEL_STYLES
from yamlformer.blocks.configs.linear import plan_style
from yamlformer.blocks.configs.tensors import TensorClass
from yamlformer.blocks.configs.tensors import table as table_class
from yamlformer.builder.adapters import adapted, quantized
from yamlformer.builder.mesh import LayoutError

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
