"""Exact analytic parameters, FLOPs and memory of a spec, without building it (torch-free).

:func:`estimate` walks the spec and sums what each block's config declares about itself
(``params``, ``flops``, ``saved_bytes``; see ``blocks/configs/``). It writes no whole-model
formula: a GQA layer, a Gemma head_dim or a sliding window is counted by the block that has it.
The conventions every figure follows live here, in :data:`CONVENTIONS`, and are printed with it.

What is estimated is two small values: a :class:`Step` (the batch one device computes and how)
and a :class:`yamlformer.builder.analysis.layout.Layout` (the devices and how the model is spread over them):
``estimate(spec, Step(seq_len=2048, batch=4), Layout(devices=64, nodes=8, tensor_parallel=8))``.
``estimate(spec, seq_len=1024)`` is short for ``estimate(spec, Step(seq_len=1024))``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from yamlformer.builder.analysis import memory as _memory
from yamlformer.builder.analysis.layout import Layout, check_tensor_parallel, sharded_memory, tensor_parallel_spec
from yamlformer.builder.analysis.shards import optimizer_bytes
from yamlformer.builder.analysis.tuning import tuning
from yamlformer.builder.optim import OptimizerConfig, optimizer_configs
from yamlformer.builder.spec.loader import load_spec
from yamlformer.builder.spec.schema import ModelSpec

#: one device, the whole model on it: what an estimate is of unless a layout says otherwise
ONE_DEVICE = Layout(strategy="ddp")

CONVENTIONS = (
    (
        "params: exact numel; a tied output projection is the embedding table, counted once under "
        "`embedding`; one table for source and target when share_encoder_decoder_embeddings"
    ),
    (
        "params.embedding: token, segment and learned-position tables (Kaplan's non-embedding = "
        "total - embedding); active: what one token meets (MoE: the router and top_k experts)"
    ),
    (
        "FLOPs: 2 per multiply-accumulate of every matrix product of one forward pass over one "
        "sequence (projections, Q.K^T and P.V over the full (seq_q, seq_k) as eager attention "
        "computes them, the head); norms, softmax, activations and lookups count 0"
    ),
    (
        "FLOPs per token: per sequence / seq_len (the target tokens in an encoder-decoder, whose "
        "encoder runs over src_len); training = 3x forward (backward = 2x), 4x with activation "
        "checkpointing (the forward runs again)"
    ),
    (
        "kernel FLOPs (for MFU): attention scores and mix over only the (query, key) pairs a tiled "
        "kernel visits under the causal mask or sliding window"
    ),
) + _memory.CONVENTIONS


@dataclass(frozen=True)
class Step:
    """What one device computes in a training step: ``batch`` sequences of ``seq_len`` tokens
    (default the spec's ``max_seq_len``; ``src_len``: an encoder-decoder's source tokens, default
    ``seq_len``) in ``dtype``, with ``activation_checkpointing`` on every layer or not, attention by
    a fused kernel (``fused_attention``: it saves no (seq, seq) tensor for backward) or eagerly.
    Under tensor parallelism the batch is one tensor-parallel group's."""

    seq_len: int | None = None
    src_len: int | None = None
    batch: int = 1
    dtype: str = "bf16"
    activation_checkpointing: bool = False
    fused_attention: bool = True
    #: the optimizer whose declared state is counted: a registered type name or its config
    #: (``yamlformer.builder.optim``; ``recipe.optimizer`` for a recipe's)
    optimizer: Any = "adamw"
    #: a frozen copy of the model kept beside it (preference tuning's reference model): its
    #: weights in the compute dtype, sharded as the model's under FSDP, counted in the training total
    reference: bool = False

    def __post_init__(self):
        problems = [
            f"{name} must be a positive int, got {value!r}"
            for name, value in (("seq_len", self.seq_len), ("src_len", self.src_len), ("batch", self.batch))
            if (value is not None or name == "batch") and not _positive_int(value)
        ]
        if self.dtype not in _memory.BYTES:
            problems.append(f"dtype must be one of {', '.join(_memory.BYTES)}, got {self.dtype!r}")
        if not isinstance(self.optimizer, OptimizerConfig) and self.optimizer not in optimizer_configs():
            problems.append(
                f"optimizer must be one of {', '.join(optimizer_configs())} or a config, got {self.optimizer!r}"
            )
        if problems:
            raise ValueError("; ".join(problems))


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class LayerEstimate:
    """One layer of one stack: parameters and forward FLOPs (one sequence) by block."""

    stack: str
    index: int
    params: dict[str, int]
    active_params: int
    flops: dict[str, int]
    kernel_flops: int
    saved_bytes: int
    description: str

    @property
    def total_params(self) -> int:
        return sum(self.params.values())

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())


@dataclass
class ParamEstimate:
    """A spec's parameters; ``trainable`` what its adapters train (which of the rest a run also
    freezes is the run's: ``model.freeze``)."""

    total: int
    trainable: int  # what the optimizer steps: the adapters' under a spec's ``adapters``, else all
    frozen: int  # the rest: weights without gradients or optimizer state
    embedding: int
    non_embedding: int
    active: int
    by_component: dict[str, int]
    #: parts of components that training runs and decoding does not, by ``component.part``
    #: (``head.mtp``: multi-token prediction), counted in their component too
    auxiliary: dict[str, int] = field(default_factory=dict)
    #: the model decoding runs: ``total`` less the auxiliary parts (DeepSeek-V3: 671B of 682.6B)
    main: int = 0


@dataclass
class FlopEstimate:
    seq_len: int
    src_len: int | None
    forward_per_sequence: int
    forward_per_token: int
    train_per_token: int
    kernel_forward_per_token: int
    kernel_train_per_token: int
    by_component: dict[str, int]  # forward, one sequence
    auxiliary: dict[str, int] = field(default_factory=dict)  # as ParamEstimate.auxiliary, forward FLOPs


@dataclass
class Estimate:
    name: str
    settings: dict[str, Any]
    params: ParamEstimate
    flops: FlopEstimate
    memory: _memory.MemoryEstimate
    layers: list[LayerEstimate] = field(repr=False)
    conventions: tuple[str, ...] = CONVENTIONS

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "settings": dict(self.settings),
            "params": dataclasses.asdict(self.params),
            "flops": dataclasses.asdict(self.flops),
            "memory": self.memory.to_dict(),
            "layers": [
                {
                    "stack": layer.stack,
                    "index": layer.index,
                    "description": layer.description,
                    "params": layer.total_params,
                    "active_params": layer.active_params,
                    "params_by_block": dict(layer.params),
                    "forward_flops": layer.total_flops,
                    "kernel_forward_flops": layer.kernel_flops,
                    "saved_bytes": layer.saved_bytes,
                }
                for layer in self.layers
            ],
            "conventions": list(self.conventions),
        }
        return out


def estimate(spec, step: Step | None = None, layout: Layout = ONE_DEVICE, **step_fields) -> Estimate:
    """Parameters, FLOPs at the step's ``seq_len`` and training memory per device.

    ``spec``: a ``ModelSpec``, a path or a mapping. ``step`` (:class:`Step`) or its fields as
    keywords (``estimate(spec, seq_len=1024, batch=2)``); ``layout``
    (:class:`yamlformer.builder.analysis.layout.Layout`): one device unless given; under ``strategy="fsdp"``
    the memory is what the rank holding the most keeps (``yamlformer.builder.analysis.layout``).
    """

    step = _step(step, step_fields)
    if not isinstance(layout, Layout):
        raise TypeError(f"layout takes a yamlformer.builder.analysis.layout.Layout, got {type(layout).__name__}")
    if not isinstance(spec, ModelSpec):
        spec = load_spec(spec)  # a path or a mapping; anything else is a TypeError saying what to pass
    _check_step(spec, step)
    if layout.strategy == "fsdp":
        check_tensor_parallel(spec, layout.tensor_parallel)
    seq_len, src_len, batch, dtype = step.seq_len, step.src_len, step.batch, step.dtype
    activation_checkpointing, fused_attention = step.activation_checkpointing, step.fused_attention
    seq = seq_len or spec.max_seq_len
    stacks = spec.stacks()
    architecture = spec.architecture_config
    memory_of = architecture.memory_of  # stack -> the stack its cross-attention reads
    src = (src_len or seq) if memory_of else None
    lengths = {name: (src if name in memory_of.values() else seq) for name in stacks}
    d, vocab = spec.d_model, spec.padded_vocab_size  # the tables and projection hold the padded rows
    act_bytes = _memory.BYTES[dtype]
    causal = architecture.causal

    params: dict[str, int] = {}
    flops: dict[str, int] = {}
    active: dict[str, int] = {}

    def add(key: str, n_params: int, n_flops: int = 0, n_active: int | None = None) -> None:
        params[key] = params.get(key, 0) + n_params
        flops[key] = flops.get(key, 0) + n_flops
        active[key] = active.get(key, 0) + (n_params if n_active is None else n_active)

    # Embeddings: lookups, no matrix product.
    # one embedding module per stack, or one that all stacks share
    modules = 1 if spec.share_encoder_decoder_embeddings else len(stacks)
    add("embedding", modules * (vocab + spec.embedding.segments) * d)
    if spec.embedding.norm is not None:
        add("embedding.norm", modules * spec.embedding.norm.params(d))
    position = spec.position
    for name, stack in stacks.items():
        n_heads = stack.attention.query_heads()
        add("position", position.params(d, n_heads, spec.max_seq_len), position.flops(d, n_heads, lengths[name]))

    tuned = tuning(spec, lengths, batch, act_bytes)
    layers: list[LayerEstimate] = []
    kernel_total = 0
    for name, stack in stacks.items():
        tokens = lengths[name]
        cross_len = lengths[memory_of[name]] if name in memory_of else None
        counted: dict[int, LayerEstimate] = {}  # identical layers (one shared config) are counted once
        for index, layer in enumerate(stack.layers()):
            if id(layer) not in counted:
                counted[id(layer)] = _layer(
                    name,
                    index,
                    layer,
                    d,
                    tokens,
                    cross_len,
                    causal[name],
                    batch,
                    act_bytes,
                    fused_attention,
                    position=position,
                )
            est = _with_adapters(dataclasses.replace(counted[id(layer)], index=index), tuned.layers.get((name, index)))
            layers.append(est)
            kernel_total += est.kernel_flops
            for block, n in est.params.items():
                block_active = est.active_params - (est.total_params - n) if block == "ffn" else n
                add(f"{name}.{block}", n, est.flops[block], block_active)
        if stack.final_norm:
            add(f"{name}.norm", stack.norm.params(d))

    head = spec.head
    last = list(stacks)[-1]
    head_flops, tied = head.flops(d, vocab, lengths[last]), spec.tie_embeddings and head.projects_to_vocab
    add("head", head.params(d, vocab, tied), head_flops, head.active_params(d, vocab, tied))
    if tuned.head[0]:
        add("head.adapters", tuned.head[0], tuned.head[1])
    kernel_total += head.kernel_flops(d, vocab, lengths[last]) - head_flops  # a head's own layers' attention
    auxiliary = {f"head.{part}": counts for part, counts in head.auxiliary(d, vocab, tied, lengths[last]).items()}

    total = sum(params.values())
    embedding = params["embedding"] + (params["position"] if position.acts_on == "embedding" else 0)
    forward = sum(flops.values())
    # the layers' attention at the FLOPs a mask-aware kernel performs, everything else as is
    kernel_forward = forward - sum(layer.total_flops for layer in layers) + kernel_total
    train_factor = 4 if activation_checkpointing else 3
    trainable = tuned.params if spec.adapters is not None else total
    param_est = ParamEstimate(
        total=total,
        trainable=trainable,
        frozen=total - trainable,
        embedding=embedding,
        non_embedding=total - embedding,
        active=sum(active.values()),
        by_component=params,
        auxiliary={name: n for name, (n, _) in auxiliary.items()},
        main=total - sum(n for n, _ in auxiliary.values()),
    )
    flop_est = FlopEstimate(
        seq_len=seq,
        src_len=src,
        forward_per_sequence=forward,
        forward_per_token=round(forward / seq),
        train_per_token=round(train_factor * forward / seq),
        kernel_forward_per_token=round(kernel_forward / seq),
        kernel_train_per_token=round(train_factor * kernel_forward / seq),
        by_component=flops,
        auxiliary={name: n for name, (_, n) in auxiliary.items()},
    )
    mem = _memory.memory(
        spec,
        total,
        layers,
        batch=batch,
        seq_len=seq,
        src_len=src,
        dtype=dtype,
        devices=layout.devices,
        strategy=layout.strategy,
        activation_checkpointing=activation_checkpointing,
        fused_attention=fused_attention,
        frozen=total - trainable,
        frozen_bytes=tuned.frozen_bytes(total - trainable, act_bytes),
        head_saved=tuned.head[2],
        optimizer=optimizer_bytes(spec, step.optimizer),  # the trainable tensors' (shards.model_tensors),
    )
    if layout.strategy == "fsdp":
        mem = _sharded(spec, layout, mem, dataclasses.replace(step, seq_len=seq))
    if step.reference:  # one rank's share of every weight: FSDP shards it over all the ranks (TP within)
        shards = layout.devices if layout.strategy == "fsdp" else 1
        mem = dataclasses.replace(mem, reference=-(-total // shards) * act_bytes)
    settings = {
        "seq_len": seq,
        "src_len": src,
        "batch": batch,
        "dtype": dtype,
        "devices": layout.devices,
        "strategy": layout.strategy,
        "activation_checkpointing": activation_checkpointing,
        "fused_attention": fused_attention,
        "optimizer": step.optimizer if isinstance(step.optimizer, str) else step.optimizer.type,
        "tensor_parallel": layout.tensor_parallel,
        "data_parallel": layout.data_parallel,
        "nodes": layout.nodes,
    }
    return Estimate(spec.name, settings, param_est, flop_est, mem, layers)


def _step(step: Step | None, fields: dict) -> Step:
    """``step``, or the :class:`Step` its fields given as keywords make; a ``TypeError`` names
    what is neither (a layout's field: the layout is a :class:`Layout`)."""
    if step is not None and not isinstance(step, Step):
        raise TypeError(f"step takes a yamlformer.builder.analysis.estimates.Step, got {type(step).__name__}")
    if not fields:
        return step or Step()
    if step is not None:
        raise TypeError("estimate() takes a Step or its fields as keywords, not both")
    known = {f.name for f in dataclasses.fields(Step)}
    unknown = sorted(set(fields) - known)
    if unknown:
        layout = {f.name for f in dataclasses.fields(Layout)}
        hint = (
            "; the devices are a Layout: estimate(spec, layout=Layout(devices=8, strategy='fsdp'))"
            if set(unknown) & layout
            else ""
        )
        raise TypeError(f"estimate() takes no {', '.join(unknown)}; a Step's fields are {', '.join(known)}{hint}")
    return Step(**fields)


def _sharded(spec, layout: Layout, mem, step: Step):
    """FSDP/TP: one tensor-parallel rank's activations and KV cache, and what the rank holding the
    most keeps of the parameters, gradients and optimizer state (``yamlformer.builder.analysis.layout``)."""
    if layout.tensor_parallel > 1:
        mem = estimate(tensor_parallel_spec(spec, layout.tensor_parallel), step).memory
    return sharded_memory(spec, layout, mem, step.optimizer)


def _layer(stack, index, layer, d, tokens, cross_len, causal, batch, act_bytes, fused, position):
    """One layer's counts (``yamlformer.blocks.configs.layer.LayerConfig``: its blocks' own, summed):
    self-attention, cross-attention (when cross_len), FFN, its norms."""
    cross = cross_len is not None
    return LayerEstimate(
        stack=stack,
        index=index,
        params=layer.params(d, cross),
        active_params=layer.active_params(d, cross),
        flops=layer.flops(d, tokens, cross_len),
        kernel_flops=layer.kernel_flops(d, tokens, causal, cross_len),
        saved_bytes=layer.saved_bytes(d, batch, tokens, act_bytes, fused, causal, position, cross_len),
        description=layer.describe(cross),
    )


def _with_adapters(layer: LayerEstimate, counts) -> LayerEstimate:
    """``layer`` with the adapters on its linear layers (``counts``: their parameters, FLOPs and
    saved bytes; None: none there) as one more block, ``adapters``."""
    if counts is None:
        return layer
    params, flops, saved = counts
    return dataclasses.replace(
        layer,
        params={**layer.params, "adapters": params},
        active_params=layer.active_params + params,
        flops={**layer.flops, "adapters": flops},
        saved_bytes=layer.saved_bytes + saved,
    )


def _check_step(spec, step: Step) -> None:
    """What a step asks that ``spec`` cannot do: more tokens than ``max_seq_len``, a source length
    for a model without one."""
    problems = [
        f"{name} {value} is more than {spec.name}'s max_seq_len {spec.max_seq_len}"
        for name, value in (("seq_len", step.seq_len), ("src_len", step.src_len))
        if value is not None and value > spec.max_seq_len
    ]
    if step.src_len is not None and not spec.architecture_config.memory_of:
        problems.append(
            f"src_len applies to encoder-decoder models (a stack that cross-attends); "
            f"{spec.name} is {spec.architecture}"
        )
    if problems:
        raise ValueError("; ".join(problems))
