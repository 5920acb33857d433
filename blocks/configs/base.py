"""The contracts: what generic code (schema rules, estimates, memory, assembly, decoding) may ask
of a block, one base class per block kind. Torch-free.

(The adapter kind's, ``AdapterBlock``, is in ``yamlformer.blocks.configs.adapters`` beside its types;
what every block says of its linear layers, in ``yamlformer.blocks.configs.linear``.)
A registered config subclasses the base of its kind (``yamlformer.blocks.registry.register`` refuses one
that does not, or that leaves an abstract method out). Generic code calls only what is declared
here; a block's own fields (``n_kv_heads``, ``sliding_window``, ``kv_lora_rank``...) are its own
business, reached through these methods. ``blocks/README.md`` is the checklist for a new block.

Shared arguments: ``d_model`` (the residual width), ``tokens``/``seq_*`` (one sequence),
``batch`` (sequences), ``act_bytes``/``dtype_bytes`` (bytes per element of the compute dtype).
Rules return located problems, ``[(loc, message)]``: ``loc`` is a path of YAML keys relative to
the block's own section (``("n_heads",)``) unless the method says otherwise, so the loader
points at the line that set the field.

A block's counts are the same at every layer index: a module may use its place (``layer_index``,
``n_layers``, given by name, ``yamlformer.blocks.build``) for values, not for shapes or work; a layer of
other shapes is an ``overrides`` entry. A block may hold blocks of other kinds (a head's own
layer): :func:`nested_block` types such a field.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SerializeAsAny, ValidationError, WithJsonSchema
from pydantic_core import PydanticCustomError

from yamlformer.blocks import registry
from yamlformer.blocks.configs.linear import LinearLayer, weight_layers
from yamlformer.blocks.configs.pairs import visible_pairs
from yamlformer.blocks.configs.tensors import TensorClass
from yamlformer.blocks.configs.traffic import Traffic, layer_norm, layout_copy

Loc = tuple[str | int, ...]
Problems = list[tuple[Loc, str]]
Shapes = dict[str, tuple[int, ...]]
#: a block's tensors by ``param_shapes`` name -> their class (``yamlformer.blocks.configs.tensors``)
Classes = dict[str, TensorClass]

#: tensor-parallel styles a block's ``parallel_plan()`` gives its submodules: ``colwise`` shards a
#: Linear's weight and bias on dim 0 (its output features); ``rowwise`` shards the weight on dim 1
#: (its input features), replicates the bias and sums the outputs; ``vocab`` shards a vocabulary
#: table or projection on dim 0 (its rows) with the outputs whole; ``replicate`` keeps the whole
#: tensor on every rank
PARALLEL_STYLES = ("colwise", "rowwise", "vocab", "replicate")


def rule_error(loc: Loc, message: str) -> PydanticCustomError:
    """What a config's own validator raises for a rule over its fields: the error carries the
    field it is about (``loc``, relative to the config), so the loader points at its line.
    ``raise rule_error(("top_k",), "top_k (3) cannot exceed n_experts (2)")``."""
    return PydanticCustomError("located_rule", "{message}", {"message": message, "loc": tuple(loc)})


class BlockConfig(BaseModel):
    """A block's own small config. Subclasses add ``type: Literal["name"] = "name"``.

    Each registered config counts what the block it describes builds (``params``: exact
    ``numel``; ``flops``: 2 per multiply-accumulate of every matrix product of one forward pass)
    beside the fields that decide the shapes, and lists ``examples`` (configs the registry-wide
    tests build, count, run and decode with).
    """

    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)

    kind: ClassVar[str]
    module_path: ClassVar[str]
    #: configs the registry-wide tests build and check (``tests/test_block_counts.py`` and others)
    examples: ClassVar[list[dict]] = []

    def describe(self) -> str:
        """A short label for per-layer tables (``describe``); the type name unless overridden."""
        return str(getattr(self, "type", type(self).__name__))

    def parallel_plan(self) -> dict[str, str] | None:
        """Tensor parallelism: submodule name (relative to the block's module) -> a style of
        :data:`PARALLEL_STYLES`; a submodule it does not name is replicated. None: no plan,
        replicated. A module whose plan splits its heads adapts to its share in
        ``use_tensor_parallel(rank, degree)`` (``yamlformer.recipes.parallel.tensor`` applies the plans)."""
        return None

    def tensor_parallel_problems(self, degree: int, d_model: int) -> Problems:
        """Why this block cannot be split ``degree`` ways by its plan: ``(field path relative to
        this config, message)`` pairs; none by default."""
        return []

    def context_parallel_problems(self, degree: int) -> Problems:
        """Why this block cannot run its share of a sequence split between ``degree``
        context-parallel ranks as its module implements it: ``(field path, message)`` pairs; none
        for a block that mixes no tokens (attention and heads with layers of their own say)."""
        return []

    def pipeline_parallel_problems(self, degree: int) -> Problems:
        """Why this block cannot sit in one pipeline stage of ``degree`` as its module runs there:
        ``(field path, message)`` pairs; none by default (a head with layers of its own says)."""
        return []

    def linear_layers(self, shapes: Shapes) -> dict[str, LinearLayer]:
        """The linear layers among this block's parameters (``shapes``: its ``param_shapes``), by module
        name, the layers a spec's ``adapters`` may adapt: by default every 2-D or stacked 3-D weight
        (:func:`~yamlformer.blocks.configs.linear.weight_layers`); a block whose module keeps a 2-D
        weight of another kind (a router: a plain ``nn.Linear``) leaves it out here."""
        return weight_layers(shapes)

    def tensor_parallel(self, degree: int, d_model: int) -> BlockConfig:
        """This block as each of ``degree`` tensor-parallel ranks holds and runs it: a config of
        the same type whose counts (``params``, FLOPs, saved bytes, KV cache) are one rank's
        share under :meth:`parallel_plan` (``yamlformer.builder.analysis.layout`` sizes activations with it). Only
        asked when :meth:`tensor_parallel_problems` is empty; a replicated block is itself."""
        return self

    # Each kind also declares ``param_shapes(...)`` (the same arguments as its ``params``): every
    # parameter tensor its module creates, named relative to the module as ``named_parameters()``
    # names it, with its shape. ``yamlformer.builder.analysis.layout`` shards them tensor by tensor. Abstract for
    # attention, FFN and norm blocks; positions and heads without parameters inherit ``{}``.

    def tensor_classes(self, *dims) -> Classes | None:
        """The class of every tensor ``param_shapes(*dims)`` names (input-like, hidden or
        output-like, and the widths its sides span: ``yamlformer.blocks.configs.tensors``), by the same
        names; muP's factors and Muon's choice of matrices come from it. None: not declared (a
        plugin's block), which a muP spec and Muon refuse at the block; a block without
        parameters declares ``{}`` by default."""
        shapes = getattr(self, "param_shapes", None)
        return {} if shapes is not None and not shapes(*dims) else None


def nested_block(kind: str, description: str):
    """The type of a field holding a block of ``kind`` inside another block (multi-token
    prediction's layer: an attention, an FFN, a norm): a mapping validated as the block its
    ``type`` names (the kind's default type when left out) among those registered when it is
    validated, so a plugin's block nests too; dumped with its own fields. A problem inside it is
    one located error (its first), at the field it names."""

    def validate(value: Any) -> Any:
        if isinstance(value, BlockConfig) or not isinstance(value, dict):
            return value  # an instance passes; anything else fails the model check below, located here
        name = value.get("type", registry.DEFAULT_TYPES.get(kind))
        if not isinstance(name, str):
            raise rule_error(("type",), f"{kind} type must be a string naming a registered block")
        try:
            cls = registry.config_class(kind, name)
        except registry.RegistryError as exc:
            raise rule_error(("type",), str(exc)) from None
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            raise first_error(exc) from None

    schema = {"type": "object", "description": f"{description} Any {kind} block, by its `type`."}
    return Annotated[SerializeAsAny[KIND_BASES[kind]], BeforeValidator(validate), WithJsonSchema(schema)]


def first_error(exc: ValidationError) -> PydanticCustomError:
    """The first error of a nested block's validation as one located rule error."""
    errors = exc.errors()
    first = errors[0]
    loc, message = tuple(first["loc"]), first["msg"]
    if first["type"] == "located_rule":
        loc, message = loc + tuple(first["ctx"]["loc"]), first["ctx"]["message"]
    elif first["type"] == "extra_forbidden":
        loc, message = loc, f"unknown key {loc[-1]!r}"
    elif first["type"] == "missing":
        message = f"missing required field {loc[-1]!r}"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return rule_error(loc, message + more)


def indivisible(degree: int, **fields: int) -> Problems:
    """A problem for each field whose value ``degree`` does not divide (tensor parallelism)."""
    return [
        (
            (name,),
            f"{value} is not a multiple of the tensor-parallel degree {degree} (degrees that "
            f"divide it: {', '.join(str(d) for d in range(1, min(value, 64) + 1) if value % d == 0)})",
        )
        for name, value in fields.items()
        if value % degree
    ]


# -- attention ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheTensor:
    """One tensor a decoding cache holds per position: ``(batch, heads, positions, width)``."""

    name: str
    heads: int
    width: int


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What one attention layer caches per token while decoding, and for how many tokens.

    Multi-head attention caches ``k`` and ``v`` (``n_kv_heads x head_dim`` each); a latent
    attention may cache one compressed vector and a shared rotary key instead. ``window``: only
    the last ``window`` positions are kept (a ring buffer). ``yamlformer.blocks.cache.TensorCache``
    allocates exactly this, so ``describe``'s KV bytes are what ``generate`` allocates.
    """

    tensors: tuple[CacheTensor, ...]
    window: int | None = None

    def positions(self, context: int) -> int:
        return min(context, self.window) if self.window is not None else context

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return sum(t.heads * t.width for t in self.tensors) * dtype_bytes

    def nbytes(self, batch: int, context: int, dtype_bytes: int) -> int:
        """Bytes for ``batch`` sequences of ``context`` tokens."""
        return batch * self.positions(context) * self.bytes_per_token(dtype_bytes)


class AttentionBlock(BlockConfig):
    """An attention block: what generic code asks of it.

    Its module is built as ``Module(config, d_model, causal=..., cross=..., backend=...)`` (any
    subset of those by name, see ``yamlformer.blocks.build``) and follows the module protocol in
    ``blocks/attention.py``: ``forward(x, inputs, cache=None, memory=None)``, ``n_heads`` and
    ``new_cache(batch, max_tokens, dtype, device)``.
    """

    #: fields a cross-attention does not take over from its stack's self-attention
    #: (``cross_attention:`` merges over ``attention:`` without them; a sliding window)
    not_inherited_by_cross: ClassVar[tuple[str, ...]] = ()

    def context_parallel_problems(self, degree: int) -> Problems:
        """An attention splits its sequence only where its module says how (``use_context_parallel``;
        its config then returns none)."""
        name = getattr(self, "type", type(self).__name__)
        return [(("type",), f"{name} attention does not split its sequence between context-parallel ranks")]

    @abstractmethod
    def query_heads(self) -> int:
        """Number of query heads (ALiBi slopes, a relative-bias table and its rules use it)."""

    @abstractmethod
    def rotary_head_dim(self, d_model: int) -> int:
        """Width of the part of each query and key head an attention-side position rotates
        (``head_dim``; MLA: ``qk_rope_head_dim``). RoPE's ``rotary_fraction`` applies to it."""

    @abstractmethod
    def params(self, d_model: int) -> int:
        """Exact parameter count."""

    @abstractmethod
    def param_shapes(self, d_model: int) -> Shapes:
        """Every parameter tensor of the module, by ``named_parameters()`` name, with its shape."""

    @abstractmethod
    def projection_flops(self, d_model: int, seq_q: int, seq_k: int, kv_input: bool = True) -> int:
        """FLOPs of every projection of one sequence (``kv_input=False``: cross-attention keys
        and values a cache already holds are left out)."""

    @abstractmethod
    def pair_flops(self, d_model: int) -> int:
        """FLOPs of the scores and the weighted sum for one (query, key) pair, all heads."""

    @abstractmethod
    def kv_cache(self, d_model: int, cross: bool = False) -> CacheLayout:
        """What decoding caches per token (``cross``: the encoder output's projections)."""

    @abstractmethod
    def saved_bytes(
        self,
        d_model: int,
        batch: int,
        seq_q: int,
        seq_k: int,
        act_bytes: int,
        fused: bool,
        masked: bool,
        kv_input: bool = True,
    ) -> int:
        """Bytes kept for backward in one training step (see ``yamlformer.builder.analysis.memory``). ``fused``: a
        FlashAttention kernel; ``masked``: eager attention adds a mask or bias to the scores;
        ``kv_input=False``: the key/value input is shared (an encoder output) and counted once."""

    def score_head_dim(self, d_model: int) -> int | None:
        """The width each query-key product sums over (muP scales scores by ``1 / width`` rather
        than ``1 / sqrt(width)``); None: not declared, which a muP spec refuses at the block."""
        return None

    def with_score_factor(self, factor: float, d_model: int) -> AttentionBlock | None:
        """This attention with every score multiplied by ``factor`` on top of the scale it has
        (muP's attention scale at another head width); None: it cannot say so (muP refuses it)."""
        return None

    def window(self) -> int | None:
        """How far back a query sees (itself included); None: no window."""
        return None

    def chunk(self) -> int | None:
        """A chunk size C: a query sees only keys of its own chunk of C positions (query ``i``
        and key ``j`` with ``i // C == j // C``); None: no chunks."""
        return None

    def rotation_fields(self) -> tuple[str, ...]:
        """The fields set on this attention that only a position block which ``rotates`` serves
        (``rope: false``, a layer's ``rope_theta``): :meth:`PositionBlock.attention_problems`
        refuses them under any other position."""
        return ()

    def visible_pairs(self, seq_q: int, seq_k: int, causal: bool) -> int:
        """(query, key) pairs the mask keeps; queries are the last ``seq_q`` positions."""
        return visible_pairs(seq_q, seq_k, causal, self.window(), self.chunk())

    def masked(self, causal: bool) -> bool:
        """Whether eager attention adds a mask to the scores (and so copies the probabilities)."""
        return causal or self.window() is not None or self.chunk() is not None

    def rotated_heads(self) -> int:
        """Query and key heads per token a rotating position block turns (each
        :meth:`rotary_head_dim` wide); by default twice the query heads (as many keys)."""
        return 2 * self.query_heads()

    def traffic(self, d_model: int, act_bytes: int) -> Traffic:
        """HBM bytes per token of the memory-bound work around the attention kernel
        (``yamlformer.blocks.configs.traffic``; the rotation is the position block's): by default the
        kernel's output copied from heads back to tokens before the output projection, one value
        per query head and head width (``pair_flops / 4``)."""
        return layout_copy(self.pair_flops(d_model) // 4, act_bytes)

    def flops(self, d_model: int, seq_q: int, seq_k: int, kv_input: bool = True) -> int:
        """Forward FLOPs of one sequence: projections, scores and mix over the full (seq_q, seq_k)
        as eager attention computes them."""
        return self.projection_flops(d_model, seq_q, seq_k, kv_input) + seq_q * seq_k * self.pair_flops(d_model)

    def kernel_flops(self, d_model: int, seq_q: int, seq_k: int, causal: bool, kv_input: bool = True) -> int:
        """Forward FLOPs a tiled kernel performs: scores and mix over the visible pairs only (MFU)."""
        pairs = self.visible_pairs(seq_q, seq_k, causal)
        return self.projection_flops(d_model, seq_q, seq_k, kv_input) + pairs * self.pair_flops(d_model)

    def kv_cache_bytes(self, d_model: int, batch: int, context: int, dtype_bytes: int, cross: bool = False) -> int:
        return self.kv_cache(d_model, cross).nbytes(batch, context, dtype_bytes)

    def problems(self, d_model: int, cross: bool) -> Problems:
        """Rules that need the model's width or the block's role (``cross``: a cross-attention)."""
        return []

    def for_cross_attention(self):
        """The config a cross-attention defaults to: this one without ``not_inherited_by_cross``."""
        fields = type(self).model_fields
        return self.model_copy(update={name: fields[name].default for name in self.not_inherited_by_cross})


class PositionBlock(BlockConfig):
    """A position block, one per stack. ``acts_on``: ``"embedding"`` (its module returns
    ``(batch, seq, d_model)`` added to the token embeddings) or ``"attention"`` (its module's
    hooks rotate q/k or add to the scores; see ``blocks/positions.py``)."""

    acts_on: ClassVar[Literal["embedding", "attention"]] = "attention"
    #: adds a term to the attention scores (ALiBi, relative bias): eager attention then masks
    biases_scores: ClassVar[bool] = False
    #: rotates queries and keys, at another base when a layer asks (its module's
    #: ``rotate(q, k, positions, theta=...)``): a layer may then set ``rope: false`` or ``rope_theta``
    rotates: ClassVar[bool] = False

    def params(self, d_model: int, n_heads: int, max_seq_len: int) -> int:
        """Parameters one stack's block builds (``n_heads``: the stack's query heads)."""
        return 0

    def param_shapes(self, d_model: int, n_heads: int, max_seq_len: int) -> Shapes:
        return {}

    def flops(self, d_model: int, n_heads: int, tokens: int) -> int:
        """Matrix-product FLOPs of one sequence (elementwise work counts 0)."""
        return 0

    def saved_bytes_per_layer(self, batch: int, seq: int, rotary_head_dim: int, act_bytes: int) -> int:
        """Bytes each attention layer keeps for backward on this block's behalf."""
        return 0

    def saved_bytes_per_stack(self, seq: int, n_heads: int, fused: bool) -> int:
        """Bytes a stack keeps once for backward on this block's behalf (shared by its layers)."""
        return 0

    def traffic_per_layer(self, heads: int, rotary_head_dim: int, act_bytes: int) -> Traffic:
        """HBM bytes per token of this block's work in each attention layer
        (``yamlformer.blocks.configs.traffic``): ``heads`` query and key heads it may rotate, each
        ``rotary_head_dim`` wide (``AttentionBlock.rotated_heads``); none by default."""
        return Traffic()

    def problems(self, d_model: int, max_seq_len: int) -> Problems:
        """Rules over this block and the model's dimensions."""
        return []

    def attention_problems(self, attention: AttentionBlock, *, d_model: int, stack_heads: int, at: Loc) -> Problems:
        """Rules over this block and one self-attention block it acts in. ``at``: where that
        attention sits in the spec; ``stack_heads``: its stack's own query heads. Locations are
        relative to the spec (this block sits at ``("position",)``). This base refuses the
        attention's :meth:`~AttentionBlock.rotation_fields` unless the block ``rotates``; an
        override adds its own rules to ``super()``'s."""
        if self.rotates:
            return []
        kind = getattr(self, "type", type(self).__name__)
        return [
            (at + (name,), f"{name} needs a rotary position block (position: {{type: rope}}); this spec's is {kind}")
            for name in attention.rotation_fields()
        ]


# -- feed-forward, norms, heads ----------------------------------------------------------------


class FFNBlock(BlockConfig):
    """A feed-forward block: ``Module(config, d_model)``, ``forward(x) -> x``-shaped. A module
    with a training-only loss exposes it as ``aux_loss`` (a tensor) after each forward."""

    @abstractmethod
    def params(self, d_model: int) -> int: ...

    @abstractmethod
    def param_shapes(self, d_model: int) -> Shapes: ...

    @abstractmethod
    def flops(self, d_model: int, tokens: int) -> int: ...

    @abstractmethod
    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int: ...

    def active_params(self, d_model: int) -> int:
        """Parameters one token meets (a mixture of experts: router, shared and top_k experts)."""
        return self.params(d_model)

    def traffic(self, d_model: int, act_bytes: int) -> Traffic:
        """HBM bytes per token of the block's memory-bound work (activations, gating, routing:
        ``yamlformer.blocks.configs.traffic``); none by default."""
        return Traffic()

    def expert_parallel_plan(self) -> tuple[str, ...]:
        """The submodules whose parameters expert parallelism splits on dim 0 (stacked routed
        experts, one row per expert) over the ``ep`` ranks; none for a dense block."""
        return ()

    def expert_parallel_problems(self, degree: int) -> Problems:
        """``(field path, message)`` for each field that keeps ``degree`` expert-parallel ranks
        from splitting this block's experts (a dense block has none to split, and no problem)."""
        return []


Placement = Literal["pre", "post", "sandwich", "post_sublayer"]


class NormBlock(BlockConfig):
    """A norm: ``Module(config, d_model)``. ``placement`` says where each layer puts it."""

    placement: Placement = Field(
        "pre",
        description="pre: norm before each sub-layer (GPT-2, Llama); post: after the residual "
        "add (the 2017 Transformer, BERT); sandwich: before and after each sub-layer (Gemma 2); "
        "post_sublayer: on the sub-layer's output before the residual add, x + norm(f(x)) (OLMo 2).",
    )

    @abstractmethod
    def params(self, d_model: int) -> int: ...

    @abstractmethod
    def param_shapes(self, d_model: int) -> Shapes: ...

    @abstractmethod
    def saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        """Bytes kept for backward (see yamlformer.builder.analysis.memory)."""

    def traffic(self, d_model: int, act_bytes: int) -> Traffic:
        """HBM bytes per token of one norm (``yamlformer.blocks.configs.traffic``); by default a
        norm computed in fp32 by one kernel, as ``F.layer_norm``."""
        return layer_norm(d_model, act_bytes)

    @property
    def per_sublayer(self) -> int:
        """Norms around each sub-layer (attention, cross-attention, FFN): 2 for sandwich."""
        return 2 if self.placement == "sandwich" else 1

    def input_saved_bytes(self, d_model: int, tokens: int, act_bytes: int) -> int:
        """Of :meth:`saved_bytes`, the bytes that are the norm's input tensor itself, not a copy:
        norms reading one tensor (a parallel-residual layer's) keep it once. The built-in norms
        keep ``x.float()``: the input itself in fp32, a copy in a 16-bit dtype."""
        return tokens * d_model * 4 if act_bytes == 4 else 0


class HeadBlock(BlockConfig):
    """An output head: ``Module(config, d_model, vocab_size, tied_embedding=None)`` (any of the
    ``yamlformer.blocks.build`` dimensions by name, and the call's ``n_layers``, ``backend``),
    ``forward(hidden, attention_mask=None, context=None) -> yamlformer.blocks.heads.HeadOutput`` (logits and
    auxiliary losses, already weighted). ``params`` leaves out a tied projection (the embedding
    table, counted there). Every count covers all the head builds and computes on a forward
    without a KV cache (``context`` given: multi-token prediction's layers included)."""

    #: whether the head's output projection can share the token embedding matrix
    projects_to_vocab: ClassVar[bool] = False
    #: the field (a ``yamlformer.blocks.configs.layer.LayerBlocks``) holding the blocks of the layers the head
    #: runs itself; in a spec it is merged over its stack's own blocks as a layer override is, and
    #: its attention meets the rules a stack's does (``yamlformer.builder.spec.schema``). None: no such layer
    layer_field: ClassVar[str | None] = None

    def params(self, d_model: int, vocab_size: int, tied: bool) -> int:
        return 0

    def context_parallel_problems(self, degree: int) -> Problems:
        """A head that runs layers of its own (``layer_field``) attends over the whole sequence
        itself, which a context-parallel rank's share is not."""
        if self.layer_field is None:
            return []
        name = getattr(self, "type", type(self).__name__)
        return [(("type",), f"the {name} head runs attention over the whole sequence itself")]

    def pipeline_parallel_problems(self, degree: int) -> Problems:
        """A head that runs layers of its own (``layer_field``) adds losses of its own, read from
        the embedding on the first stage, which the last stage's loss does not have."""
        if self.layer_field is None:
            return []
        name = getattr(self, "type", type(self).__name__)
        return [
            (("type",), f"the {name} head's own losses read the embedding, which the last pipeline stage does not hold")
        ]

    def active_params(self, d_model: int, vocab_size: int, tied: bool) -> int:
        """Parameters one token meets (a mixture of experts in the head's own layers: top_k)."""
        return self.params(d_model, vocab_size, tied)

    def auxiliary(self, d_model: int, vocab_size: int, tied: bool, tokens: int) -> dict[str, tuple[int, int]]:
        """The parts of the head that training runs and decoding does not (DeepSeek-V3's
        multi-token-prediction modules), by the name of the head's submodule that holds them:
        ``(params, forward FLOPs over tokens)``, both already counted in :meth:`params` and
        :meth:`flops`. Reports show each as its own row (``head.mtp``) and give the main model's
        total without them (DeepSeek-V3's 671B). ``{}``: none."""
        return {}

    def param_shapes(self, d_model: int, vocab_size: int, tied: bool) -> Shapes:
        return {}

    def flops(self, d_model: int, vocab_size: int, tokens: int) -> int:
        return 0

    def kernel_flops(self, d_model: int, vocab_size: int, tokens: int) -> int:
        """Forward FLOPs with the attention of the head's own layers over the (query, key) pairs a
        tiled kernel visits (MFU); :meth:`flops` for a head without layers."""
        return self.flops(d_model, vocab_size, tokens)

    def traffic(self, d_model: int, vocab_size: int, act_bytes: int, compiled_loss: bool = False) -> Traffic:
        """HBM bytes per token of the head's memory-bound work, its training loss included
        (``yamlformer.blocks.configs.traffic``; ``compiled_loss`` as :func:`loss_saved_bytes`); none by default."""
        return Traffic()

    def saved_bytes(
        self,
        d_model: int,
        vocab_size: int,
        tokens: int,
        act_bytes: int,
        *,
        batch: int = 1,
        fused: bool = True,
        position: PositionBlock | None = None,
        compiled_loss: bool = False,
    ) -> int:
        """Bytes kept for backward, the training loss included (see yamlformer.builder.analysis.memory);
        ``tokens`` over ``batch`` sequences. ``fused`` and ``position`` (the spec's position
        block) are what the head's own layers' attention needs, as a stack's layer does;
        ``compiled_loss``: the loss is compiled with the head (see :func:`loss_saved_bytes`)."""
        return 0


def loss_saved_bytes(tokens: int, vocab_size: int, compiled_loss: bool = False) -> int:
    """What a vocabulary cross-entropy keeps for backward beyond the logits: eagerly the fp32
    log-probabilities (``log_softmax`` of the logits upcast); compiled (torch.compile fusing the
    upcast, the log-softmax and the loss, as a compiled training step or torchtitan's compiled
    loss does) an fp32 log-sum-exp per token."""
    return tokens * 4 if compiled_loss else tokens * vocab_size * 4


# -- architectures -----------------------------------------------------------------------------


class ArchitectureBlock(BlockConfig):
    """Which stacks of layers a model has and how they connect (the spec's ``architecture``)."""

    #: the spec's stacks this architecture needs, in the order they run; the last feeds the head
    stacks: ClassVar[tuple[str, ...]]
    #: whether each stack's self-attention is causal
    causal: ClassVar[dict[str, bool]] = {"encoder": False, "decoder": True}
    #: stack -> the stack whose output its cross-attention reads (an encoder-decoder's decoder)
    memory_of: ClassVar[dict[str, str]] = {}

    def decoding_stack(self) -> str | None:
        """The stack ``generate`` decodes with a KV cache (None: the model does not generate)."""
        last = self.stacks[-1]
        return last if self.causal.get(last) else None


#: the base class each registry kind's configs subclass
KIND_BASES: dict[str, type[BlockConfig]] = {
    "attention": AttentionBlock,
    "position": PositionBlock,
    "ffn": FFNBlock,
    "norm": NormBlock,
    "head": HeadBlock,
    "architecture": ArchitectureBlock,
}  # and "adapter": AdapterBlock, whose contract is in yamlformer.blocks.configs.adapters
registry.declare_contracts(KIND_BASES)
