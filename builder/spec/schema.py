"""The spec schema: :class:`ModelSpec` and its sections, for every field of the spec format.

``from yamlformer.builder.spec.schema import ModelSpec`` is a static class to annotate with: its block fields
are typed by their contracts (``AttentionBlock``, ``FFNBlock``... in ``yamlformer.blocks.configs.base``),
which is all generic code may ask of them. Validation runs on :func:`spec_model`, a subclass of
each section whose block fields are discriminated unions of the blocks registered now, so a
block registered later (a user's plugin) joins the schema and the JSON Schema at once; it is
rebuilt when the registry changes. ``ModelSpec.model_validate(data)`` validates with it.

Before validation each stack's ``cross_attention`` and per-layer ``overrides`` are completed
from the stack's own blocks through the one merge (``yamlformer.builder.spec.merge``), which carries where each
field was written. Cross-field rules that need the whole spec live in :func:`rule_errors`; a
block's own rules live with the block; every rule names the field it is about so the loader can
point at its line.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    create_model,
    model_validator,
)

from yamlformer.blocks import registry
from yamlformer.blocks.configs.adapters import AdapterBlock
from yamlformer.blocks.configs.base import (
    ArchitectureBlock,
    AttentionBlock,
    FFNBlock,
    HeadBlock,
    Loc,
    NormBlock,
    PositionBlock,
)
from yamlformer.blocks.configs.layer import LayerConfig
from yamlformer.blocks.limits import MAX_LAYERS, MAX_OVERRIDES, MAX_SEQ_LEN, MAX_VOCAB, MAX_VOCAB_PADDING, MAX_WIDTH
from yamlformer.builder.adapters import adapter_problems
from yamlformer.builder.parametrization import Parametrization, StandardParametrization
from yamlformer.builder.parametrization import problems as parametrization_problems
from yamlformer.builder.spec.merge import merge

#: the type a block field takes when its ``type`` key is left out, by block kind
DEFAULT_TYPES = registry.DEFAULT_TYPES
#: the same by spec field name, for the merge (a cross-attention is an attention block)
FIELD_TYPES = {**DEFAULT_TYPES, "cross_attention": DEFAULT_TYPES["attention"]}
#: stack-level block fields that per-layer ``overrides`` may change
LAYER_FIELDS = ("attention", "cross_attention", "ffn", "norm")
#: a stack's blocks that a head's own layer (``HeadBlock.layer_field``) is merged over
HEAD_LAYER_FIELDS = ("attention", "ffn", "norm")


class SpecRuleError(Exception):
    """Cross-field rule violations, each with the field path it is about.

    Not a ValueError on purpose: pydantic passes it through untouched, locations intact.
    """

    def __init__(self, problems: list[tuple[Loc, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems))


def block_union(kind: str):
    """A field type accepting any registered block of ``kind``, chosen by its ``type`` key."""
    classes = registry.configs(kind)
    default = DEFAULT_TYPES.get(kind)

    def discriminate(value):
        if isinstance(value, dict):
            return value.get("type", default)
        return getattr(value, "type", None)

    members = tuple(Annotated[cls, Tag(name)] for name, cls in classes.items())
    union = Union[members] if len(members) > 1 else members[0]  # noqa: UP007
    return Annotated[
        union,
        Discriminator(
            discriminate,
            custom_error_type="unknown_block_type",
            custom_error_message=f"{kind} type must be one of: {', '.join(classes)}",
        ),
    ]


def parse_layers(layers: str | list[int], n_layers: int) -> list[int]:
    """Layer indices from a Python-style slice string ("0::2", "-4:") or a list of ints."""
    return sorted(selected_layers(layers, n_layers))


def selected_layers(layers: str | list[int], n_layers: int) -> range | frozenset[int]:
    """The layers ``layers`` selects, with O(1) membership: a ``range`` for a slice string, a set
    for a list. Raises ``ValueError`` for a string that is not a slice."""
    if isinstance(layers, str):
        parts = layers.split(":")
        if len(parts) > 3:
            raise ValueError(f"{layers!r} is not a slice like '0::2'")
        try:
            bounds = [int(p) if p.strip() else None for p in parts]
        except ValueError:
            raise ValueError(f"{layers!r} is not a slice like '0::2' or '1:8'") from None
        if len(bounds) == 1:
            index = bounds[0]
            return range(index % n_layers, index % n_layers + 1) if -n_layers <= index < n_layers else range(0)
        if len(bounds) == 3 and bounds[2] == 0:
            raise ValueError("a slice step cannot be 0")
        return range(n_layers)[slice(*bounds)]
    return frozenset(i % n_layers for i in layers if -n_layers <= i < n_layers)


def _cross_base(attention: Any) -> Any:
    """The fields of a self-attention mapping a cross-attention takes over (its block decides)."""
    if not isinstance(attention, dict):
        return attention
    kind = attention.get("type", DEFAULT_TYPES["attention"])
    cls = registry.configs("attention").get(kind) if isinstance(kind, str) else None  # else validation says
    dropped = cls.not_inherited_by_cross if cls is not None else ()
    return {k: v for k, v in attention.items() if k not in dropped}


def spread_layer_defaults(data: Any, doc=None, stacks: tuple[str, ...] = ("encoder", "decoder")) -> Any:
    """Before validation: each stack's ``cross_attention`` merged over its ``attention`` (less
    what that block does not hand to a cross-attention), each override's blocks merged over the
    stack's (a different ``type`` replaces), and a head's own layer (``HeadBlock.layer_field``)
    merged over the blocks of the stack that feeds it. ``doc``: the located document of ``data``;
    the merge records there where each inherited field was written."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for name in stacks:
        if isinstance(data.get(name), dict):
            data[name] = _spread_stack(data[name], (name,), doc)
    head = data.get("head")
    if isinstance(head, dict):
        data["head"] = _spread_head(head, data, doc)
    return data


def _spread_head(head: dict, data: dict, doc) -> dict:
    """The head with its own layer merged over its stack's blocks (when its block has one)."""
    cls = registry.configs("head").get(head.get("type")) if isinstance(head.get("type"), str) else None
    field = getattr(cls, "layer_field", None)
    kind = data.get("architecture")
    architecture = registry.configs("architecture").get(kind) if isinstance(kind, str) else None
    if field is None or architecture is None or not isinstance(head.get(field, {}), dict):
        return head  # nothing to merge, or validation names what is wrong
    name = architecture.stacks[-1]
    stack = data.get(name)
    if not isinstance(stack, dict):
        return head
    own, at = dict(head.get(field) or {}), ("head", field)
    for key in HEAD_LAYER_FIELDS:
        if isinstance(stack.get(key), dict) and isinstance(own.get(key, {}), dict):
            own[key] = merge(
                stack[key], own.get(key, {}), types=FIELD_TYPES, out=doc, at=at + (key,), base_from=(doc, (name, key))
            )
    for key in ("dropout", "parallel_residual"):  # as a layer override keeps its stack's
        if key in stack and key not in own:
            own[key] = stack[key]
    return {**head, field: own}


def _spread_stack(stack: dict, at: Loc, doc) -> dict:
    stack = dict(stack)
    attention = stack.get("attention")
    cross_base = _cross_base(attention)

    def over(base, base_at: Loc, update, update_at: Loc):
        return merge(base, update, types=FIELD_TYPES, out=doc, at=update_at, base_from=(doc, base_at))

    if isinstance(attention, dict) and isinstance(stack.get("cross_attention"), dict):
        stack["cross_attention"] = over(
            cross_base, at + ("attention",), stack["cross_attention"], at + ("cross_attention",)
        )
    overrides = stack.get("overrides")
    if isinstance(overrides, list):
        spread = []
        for i, override in enumerate(overrides):
            if isinstance(override, dict):
                override = dict(override)
                for key in LAYER_FIELDS:
                    base, base_at = stack.get(key), at + (key,)
                    if key == "cross_attention" and base is None:
                        base, base_at = cross_base, at + ("attention",)
                    if isinstance(base, dict) and isinstance(override.get(key), dict):
                        override[key] = over(base, base_at, override[key], at + ("overrides", i, key))
            spread.append(override)
        stack["overrides"] = spread
    return stack


_PARTIAL = WithJsonSchema({"type": "object", "description": "Fields merged over the stack's own block of this kind."})


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)


class EmbeddingSpec(_Section):
    """Token embeddings."""

    scale: Literal["none", "sqrt_d"] = Field(
        "none", description="sqrt_d multiplies token embeddings by sqrt(d_model) (2017 Transformer, Gemma)."
    )
    scale_in_model_dtype: bool = Field(
        False,
        description="Round the sqrt(d_model) factor to the model's dtype before multiplying, as "
        "Gemma does (in bf16, sqrt(3072) = 55.43 becomes 55.5); false multiplies by it exactly.",
    )
    norm: NormBlock | None = Field(None, description="A norm right after the embeddings (BERT); null: none.")
    segments: int = Field(
        0, ge=0, le=MAX_VOCAB, description=">0 adds a token-type (segment) table of that size (BERT: 2)."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the summed embeddings.")


class LayerOverride(_Section):
    """Layers that differ from the rest of their stack."""

    layers: (
        Annotated[str, Field(max_length=64)]
        | Annotated[list[Annotated[int, Field(ge=-MAX_LAYERS, le=MAX_LAYERS)]], Field(max_length=MAX_LAYERS)]
    ) = Field(..., description="A Python-style slice over layer indices ('0::2') or a list [0, 5, 7].")
    attention: AttentionBlock | None = Field(None, description="Merged over the stack's attention.")
    cross_attention: AttentionBlock | None = Field(None, description="Merged over the stack's cross-attention.")
    ffn: FFNBlock | None = Field(
        None, description="Merged over the stack's ffn; a different type replaces it (hybrids)."
    )
    norm: NormBlock | None = Field(None, description="Merged over the stack's norm.")
    dropout: float | None = Field(None, ge=0, lt=1, description="This layer's sub-layer dropout.")


class StackSpec(_Section):
    """A stack of layers (the spec's ``decoder:`` or ``encoder:``)."""

    n_layers: int = Field(..., ge=1, le=MAX_LAYERS, description="Number of layers in the stack.")
    attention: AttentionBlock = Field(..., description="Self-attention of every layer.")
    cross_attention: AttentionBlock | None = Field(
        None,
        description="Decoder of an encoder-decoder: attention over the encoder's output; "
        "fields merge over attention's; null means the same as attention (without its window).",
    )
    ffn: FFNBlock = Field(default_factory=lambda: {"type": "mlp"}, description="The feed-forward block.")
    norm: NormBlock = Field(
        default_factory=lambda: {"type": "layernorm"}, description="The norm block and its placement."
    )
    final_norm: bool = Field(True, description="A norm after the last layer (pre-norm stacks have one).")
    dropout: float = Field(0.0, ge=0, lt=1, description="On each sub-layer's output, before the residual add.")
    parallel_residual: bool | Literal["shared_norm"] = Field(
        False,
        description="false: attention, then the FFN; true: both read the layer's input and are added, "
        "x + attn(attention_norm(x)) + ffn(ffn_norm(x)) (GPT-NeoX); shared_norm: one norm feeds both, "
        "h = attention_norm(x), x + attn(h) + ffn(h) (GPT-J, Falcon). Cross-attention, where there is "
        "one, is a third branch; a head's own layers (multi-token prediction) take the stack's value.",
    )
    overrides: list[LayerOverride] = Field(
        default_factory=list, max_length=MAX_OVERRIDES, description="Layers that differ from the rest of the stack."
    )

    def layer_indices(self, override: LayerOverride) -> list[int]:
        return parse_layers(override.layers, self.n_layers)

    def layer(self, index: int) -> LayerConfig:
        """Layer ``index``'s blocks, later overrides winning over earlier ones."""
        n = self.n_layers
        if not -n <= index < n:
            raise IndexError(f"layer {index} of a stack of {n}")
        chosen = tuple(j for j, o in enumerate(self.overrides) if index % n in selected_layers(o.layers, n))
        return self._resolved(chosen)

    def layers(self) -> list[LayerConfig]:
        """Every layer's blocks, in order; identical layers are one shared object."""
        out: list[LayerConfig] = [None] * self.n_layers  # type: ignore[list-item]
        for indices, layer in self.layer_groups():
            for i in indices:
                out[i] = layer
        return out

    def layer_groups(self) -> list[tuple[list[int], LayerConfig]]:
        """Layers built from the same blocks together: ``(their indices, the layer)``, ordered by
        first index. Costs grow with the selections the overrides make, not layers x overrides
        (a stack of identical layers is one group), so counting 10,000 layers stays instant."""
        chosen: list[list[int]] = [[] for _ in range(self.n_layers)]
        for j, override in enumerate(self.overrides):
            for i in selected_layers(override.layers, self.n_layers):
                chosen[i].append(j)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, overrides in enumerate(chosen):
            groups.setdefault(tuple(overrides), []).append(i)
        return [(indices, self._resolved(key)) for key, indices in groups.items()]

    def _resolved(self, overrides: tuple[int, ...]) -> LayerConfig:
        """The stack's blocks with the ``overrides`` (indices, in order) laid over them."""
        fields = {key: getattr(self, key) for key in LAYER_FIELDS}
        if fields["cross_attention"] is None:
            fields["cross_attention"] = self.attention.for_cross_attention()
        dropout = self.dropout
        for j in overrides:
            override = self.overrides[j]
            for key in LAYER_FIELDS:
                if getattr(override, key) is not None:
                    fields[key] = getattr(override, key)
            if override.dropout is not None:
                dropout = override.dropout
        return LayerConfig(dropout=dropout, parallel_residual=self.parallel_residual, **fields)


class ModelSpec(_Section):
    """A Transformer, declared. Attribute names are the YAML keys.

    Validate with ``ModelSpec.model_validate(data)`` (or ``yamlformer.builder.load_spec``): it runs on
    :func:`spec_model`, whose instances are instances of this class.
    """

    #: the fields that hold stacks of layers
    stack_fields: ClassVar[tuple[str, ...]] = ("encoder", "decoder")

    name: str = Field("model", description="Free text, shown in reports.")
    # resolved when the file is read: a validated spec's dump (a checkpoint's, load_spec(mapping))
    # holds every field already, so it leaves the path out
    extends: str | None = Field(
        None, exclude=True, description="A spec this one overrides (path relative to this file)."
    )
    architecture: str = Field(..., description="decoder-only | encoder-only | encoder-decoder.")
    vocab_size: int = Field(..., ge=1, le=MAX_VOCAB, description="Number of token ids.")
    pad_vocab_to_multiple_of: int = Field(
        1,
        ge=1,
        le=MAX_VOCAB_PADDING,
        description="The embedding table and output projection hold vocab_size rounded up to a multiple of this "
        "(Megatron-LM pads to 128 x the tensor-parallel degree, so the vocabulary splits over its ranks); the padded "
        "ids' logits are cut off before the loss and sampling, and Hugging Face exports and imports stay unpadded. "
        "1: no padding.",
    )
    d_model: int = Field(..., ge=1, le=MAX_WIDTH, description="Width of the residual stream.")
    max_seq_len: int = Field(..., ge=1, le=MAX_SEQ_LEN, description="Longest sequence the model is built for.")
    tie_embeddings: bool = Field(False, description="Output projection shares the input embedding matrix.")
    share_encoder_decoder_embeddings: bool = Field(
        True, description="encoder-decoder only: one table for source and target."
    )
    embedding: EmbeddingSpec = Field(default_factory=dict, description="Token embeddings.")
    position: PositionBlock = Field(
        default_factory=lambda: {"type": "rope"},
        description="sinusoidal | learned | rope | alibi | relative_bias | none, with its knobs.",
    )
    decoder: StackSpec | None = Field(None, description="The causal stack of decoder-only and encoder-decoder models.")
    encoder: StackSpec | None = Field(
        None, description="The bidirectional stack of encoder-only and encoder-decoder models."
    )
    head: HeadBlock = Field(default_factory=lambda: {"type": "lm"}, description="lm | mlm | classification | none.")
    adapters: AdapterBlock | None = Field(
        None,
        description="Fine-tuning adapters on linear layers: {type: lora | dora, rank, alpha, dropout, targets, "
        "quantize}. The base model's parameters then do not train; the adapters' do. null: none.",
    )
    parametrization: Parametrization = Field(
        default_factory=StandardParametrization,
        description="How init and learning rates scale with the width: {type: standard} (as written) | "
        "{type: mup, base_d_model, base_hidden_dim, base_head_dim, output_multiplier} (Tensor Programs V: "
        "the hyperparameters tuned at the base width hold at this one).",
    )

    @classmethod
    def model_validate(cls, obj: Any, *args, **kwargs):
        if cls is ModelSpec:  # the static class: validate with the registered blocks
            return spec_model().model_validate(obj, *args, **kwargs)
        return super().model_validate(obj, *args, **kwargs)

    @classmethod
    def model_json_schema(cls, *args, **kwargs) -> dict[str, Any]:
        if cls is ModelSpec:
            return spec_model().model_json_schema(*args, **kwargs)
        return super().model_json_schema(*args, **kwargs)

    @model_validator(mode="before")
    @classmethod
    def _spread(cls, data: Any, info: ValidationInfo) -> Any:
        document = (info.context or {}).get("document")
        return spread_layer_defaults(data, document, cls.stack_fields)

    @model_validator(mode="after")
    def _rules(self):
        problems = rule_errors(self)
        if problems:
            raise SpecRuleError(problems)
        return self

    @property
    def architecture_config(self) -> ArchitectureBlock:
        return registry.config_class("architecture", self.architecture)()

    @property
    def padded_vocab_size(self) -> int:
        """The rows of the embedding table and the output projection: ``vocab_size`` rounded up to
        a multiple of ``pad_vocab_to_multiple_of``."""
        multiple = self.pad_vocab_to_multiple_of
        return -(-self.vocab_size // multiple) * multiple

    def stacks(self) -> dict[str, StackSpec]:
        """The stacks this architecture runs, by name, in order."""
        return {name: getattr(self, name) for name in self.architecture_config.stacks}


_CACHE: dict[int, type[ModelSpec]] = {}


def spec_model() -> type[ModelSpec]:
    """The ``ModelSpec`` subclass for the blocks registered now (rebuilt when that changes)."""
    version = registry.version()
    if version not in _CACHE:
        _CACHE.clear()
        _CACHE[version] = _build_spec_model()
    return _CACHE[version]


def _section(cls: type[_Section], **types) -> type:
    """A subclass of ``cls`` whose fields named in ``types`` take those types (and keep their
    defaults and descriptions)."""
    fields = {name: (tp, cls.model_fields[name]) for name, tp in types.items()}
    sub = create_model(cls.__name__, __base__=cls, __module__=cls.__module__, **fields)
    sub.__qualname__ = cls.__qualname__
    return sub


def _build_spec_model() -> type[ModelSpec]:
    Attention, FFN, Norm = block_union("attention"), block_union("ffn"), block_union("norm")
    Embedding = _section(EmbeddingSpec, norm=Optional[Norm])  # noqa: UP045 (runtime-built unions)
    Override = _section(
        LayerOverride,
        attention=Annotated[Attention | None, _PARTIAL],
        cross_attention=Annotated[Attention | None, _PARTIAL],
        ffn=Annotated[FFN | None, _PARTIAL],
        norm=Annotated[Norm | None, _PARTIAL],
    )
    Stack = _section(
        StackSpec,
        attention=Attention,
        cross_attention=Optional[Attention],  # noqa: UP045
        ffn=FFN,
        norm=Norm,
        overrides=list[Override],
    )
    return _section(
        ModelSpec,
        architecture=Literal[tuple(registry.configs("architecture"))],
        embedding=Embedding,
        position=block_union("position"),
        decoder=Optional[Stack],  # noqa: UP045
        encoder=Optional[Stack],  # noqa: UP045
        head=block_union("head"),
        adapters=Optional[block_union("adapter")],  # noqa: UP045
    )


def rule_errors(spec) -> list[tuple[Loc, str]]:
    """Cross-field rules over a spec whose fields are each valid on their own.

    The rules of a block kind live with its blocks (``problems``, ``attention_problems``; see
    ``yamlformer.blocks.configs.base``); here they are asked, and their locations placed in the spec.
    """
    problems: list[tuple[Loc, str]] = []
    architecture = spec.architecture_config
    needed = architecture.stacks
    for name in ("encoder", "decoder"):
        stack = getattr(spec, name)
        if name in needed and stack is None:
            problems.append(((("architecture",)), f"{spec.architecture} needs a `{name}:` stack"))
        elif name not in needed and stack is not None:
            problems.append(((name,), f"{spec.architecture} has no {name}; remove `{name}:`"))
    for name in needed:
        stack = getattr(spec, name)
        if stack is not None:
            problems += _stack_rules(spec, name, stack, cross_allowed=name in architecture.memory_of)
    problems += _at(("position",), spec.position.problems(spec.d_model, spec.max_seq_len))
    field = type(spec.head).layer_field
    if field is not None:  # the head's own layer: its attention's rules, as a stack's
        attention, loc = getattr(spec.head, field).attention, ("head", field, "attention")
        own = _at(loc, attention.problems(spec.d_model, cross=False))
        stack_heads = spec.stacks()[architecture.stacks[-1]].attention.query_heads()
        problems += own or spec.position.attention_problems(
            attention, d_model=spec.d_model, stack_heads=stack_heads, at=loc
        )
    if not problems:  # the targets are resolved against the model the rest of the spec makes
        problems += adapter_problems(spec)
    if not problems:  # the parametrization reads every block's tensors: only once they are sound
        problems += parametrization_problems(spec)
    return problems


def _at(loc: Loc, problems: list[tuple[Loc, str]]) -> list[tuple[Loc, str]]:
    """A block's problems (located within the block) located within the spec."""
    return [(loc + tuple(where), message) for where, message in problems]


def _stack_rules(spec, name: str, stack, cross_allowed: bool) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    attentions: list[tuple[Loc, Any]] = [((name, "attention"), stack.attention)]
    if stack.cross_attention is not None:
        attentions.append(((name, "cross_attention"), stack.cross_attention))
    elif cross_allowed:  # the cross-attention the stack's attention implies is asked its rules too
        implied = stack.attention.for_cross_attention().problems(spec.d_model, cross=True)
        problems += [
            (
                (name, "attention") + tuple(where),
                f"{message} (the cross-attention defaults to this attention; set cross_attention)",
            )
            for where, message in implied
        ]
    for i, override in enumerate(stack.overrides):
        loc = (name, "overrides", i)
        try:
            indices = stack.layer_indices(override)
        except ValueError as exc:
            problems.append((loc + ("layers",), str(exc)))
            continue
        if not indices:
            problems.append(
                (loc + ("layers",), f"selects no layer of {stack.n_layers} (indices 0..{stack.n_layers - 1})")
            )
        if isinstance(override.layers, list):
            bad = [i for i in override.layers if not -stack.n_layers <= i < stack.n_layers]
            if bad:
                problems.append((loc + ("layers",), f"layer {bad[0]} is out of range for {stack.n_layers} layers"))
        for key in ("attention", "cross_attention"):
            if getattr(override, key) is not None:
                attentions.append((loc + (key,), getattr(override, key)))
    if stack.parallel_residual and not problems:  # every layer's norm placement must allow it
        for indices, layer in stack.layer_groups():
            if (problem := layer.parallel_problem()) is not None:
                problems.append(((name, "parallel_residual"), f"{problem} (layer {indices[0]})"))
                break
    stack_heads = stack.attention.query_heads()
    for loc, attention in attentions:
        cross = loc[-1] == "cross_attention"
        if cross and not cross_allowed:
            problems.append((loc, "cross-attention exists only in the decoder of an encoder-decoder"))
            continue
        own = _at(loc, attention.problems(spec.d_model, cross=cross))
        problems += own
        if not own and not cross:  # the position acts in self-attention only
            problems += spec.position.attention_problems(
                attention, d_model=spec.d_model, stack_heads=stack_heads, at=loc
            )
    return problems
