"""The contracts: what generic code (schema rules, estimates, memory, assembly, decoding) may ask
of a block, one base class per block kind. Torch-free.

(What every kind's base shares, ``BlockConfig`` and the located errors, is in
``yamlformer.blocks.configs.block``; the attention and position kinds', which describe a decoding
cache, in ``yamlformer.blocks.configs.base_attention``; the adapter kind's, ``AdapterBlock``, in
``yamlformer.blocks.configs.adapters`` beside its types; what every block says of its linear
layers, in ``yamlformer.blocks.configs.linear``. All of them are taken from here.)
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

from abc import abstractmethod
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, SerializeAsAny, ValidationError, WithJsonSchema

from yamlformer.blocks import registry
from yamlformer.blocks.configs.base_attention import AttentionBlock, CacheLayout, CacheTensor, PositionBlock
from yamlformer.blocks.configs.block import (
    PARALLEL_STYLES,
    BlockConfig,
    Classes,
    Loc,
    Problems,
    Shapes,
    first_error,
    indivisible,
    rule_error,
)
from yamlformer.blocks.configs.traffic import Traffic, layer_norm

#: what the blocks take from here: every kind's contract, and what a contract is made of
#: (``yamlformer.blocks.configs.block``; attention's and positions' in ``.base_attention``)
__all__ = [
    "KIND_BASES",
    "PARALLEL_STYLES",
    "ArchitectureBlock",
    "AttentionBlock",
    "BlockConfig",
    "CacheLayout",
    "CacheTensor",
    "Classes",
    "FFNBlock",
    "HeadBlock",
    "Loc",
    "NormBlock",
    "PositionBlock",
    "Problems",
    "Shapes",
    "first_error",
    "indivisible",
    "loss_saved_bytes",
    "nested_block",
    "rule_error",
]


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
