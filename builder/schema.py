"""The spec schema: Pydantic models for every field of the spec format.

Block choices (``position``, ``ffn``, ``norm``, ``head``, ``attention``) are discriminated
unions built from the block registry, so a block registered later (a user's plugin) is part of
the schema and the JSON Schema at once: :func:`spec_model` rebuilds when the registry changes.
Cross-field rules that need the whole spec live in :func:`rule_errors`; they name the field
they are about so the loader can point at its line.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, WithJsonSchema, model_validator

from blocks import registry
from blocks.configs.layer import LayerConfig

Loc = tuple[Union[str, int], ...]

#: the type a block field takes when its ``type`` key is left out
DEFAULT_TYPES = {"attention": "multi_head", "ffn": "mlp", "norm": "layernorm"}
#: stack-level block fields that per-layer ``overrides`` may change
LAYER_FIELDS = ("attention", "cross_attention", "ffn", "norm")


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
    if isinstance(layers, str):
        parts = layers.split(":")
        if len(parts) > 3:
            raise ValueError(f"{layers!r} is not a slice like '0::2'")
        try:
            bounds = [int(p) if p.strip() else None for p in parts]
        except ValueError:
            raise ValueError(f"{layers!r} is not a slice like '0::2' or '1:8'") from None
        if len(bounds) == 1:
            return [range(n_layers)[bounds[0]]] if -n_layers <= bounds[0] < n_layers else []
        if len(bounds) == 3 and bounds[2] == 0:
            raise ValueError("a slice step cannot be 0")
        return list(range(n_layers))[slice(*bounds)]
    return [i % n_layers for i in layers if -n_layers <= i < n_layers]


def _merge(base: Any, update: Any) -> Any:
    """Mappings merge key by key; anything else replaces."""
    if isinstance(base, dict) and isinstance(update, dict):
        merged = dict(base)
        for key, value in update.items():
            merged[key] = _merge(base.get(key), value)
        return merged
    return copy.deepcopy(update)


def _same_type(kind: str, base: dict, update: dict) -> bool:
    default = DEFAULT_TYPES.get(kind)
    return update.get("type", base.get("type", default)) == base.get("type", default)


def _cross_base(attention: Any) -> Any:
    """The fields of a self-attention mapping a cross-attention takes over (its block decides)."""
    if not isinstance(attention, dict):
        return attention
    cls = registry.configs("attention").get(attention.get("type", DEFAULT_TYPES["attention"]))
    dropped = cls.not_inherited_by_cross if cls is not None else ()
    return {k: v for k, v in attention.items() if k not in dropped}


def _spread_stack_defaults(data: Any) -> Any:
    """Before validation: complete cross-attention and overrides from the stack's own fields.

    ``cross_attention`` fields merge over ``attention`` (without its window); each override's
    block fields merge over the stack's (a different ``type`` replaces instead).
    """
    if not isinstance(data, dict):
        return data
    data = dict(data)
    attention = data.get("attention")
    if isinstance(attention, dict) and isinstance(data.get("cross_attention"), dict):
        data["cross_attention"] = _merge(_cross_base(attention), data["cross_attention"])
    overrides = data.get("overrides")
    if isinstance(overrides, list):
        spread = []
        for override in overrides:
            if isinstance(override, dict):
                override = dict(override)
                for key in LAYER_FIELDS:
                    base = data.get(key)
                    if key == "cross_attention" and base is None:
                        base = _cross_base(attention or {})
                    update = override.get(key)
                    if isinstance(base, dict) and isinstance(update, dict):
                        if _same_type(key, base, update):
                            override[key] = _merge(base, update)
            spread.append(override)
        data["overrides"] = spread
    return data


_PARTIAL = WithJsonSchema(
    {"type": "object", "description": "Fields merged over the stack's own block of this kind."}
)

_CACHE: dict[int, type] = {}


def spec_model() -> type:
    """The ``ModelSpec`` class for the blocks registered now (rebuilt when that changes)."""
    version = registry.version()
    if version not in _CACHE:
        _CACHE.clear()
        _CACHE[version] = _build_spec_model()
    return _CACHE[version]


def _build_spec_model() -> type:  # noqa: C901  (one class per spec section, kept together)
    Attention = block_union("attention")
    Position = block_union("position")
    FFN = block_union("ffn")
    Norm = block_union("norm")
    Head = block_union("head")
    Architecture = Literal[tuple(registry.configs("stack"))]

    class _Section(BaseModel):
        model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)

    class EmbeddingConfig(_Section):
        scale: Literal["none", "sqrt_d"] = Field(
            "none", description="sqrt_d multiplies token embeddings by sqrt(d_model) (2017 Transformer, Gemma)."
        )
        scale_in_model_dtype: bool = Field(
            False,
            description="Round the sqrt(d_model) factor to the model's dtype before multiplying, as "
            "Gemma does (in bf16, sqrt(3072) = 55.43 becomes 55.5); false multiplies by it exactly.",
        )
        norm: Norm | None = Field(None, description="A norm right after the embeddings (BERT); null: none.")
        segments: int = Field(0, ge=0, description=">0 adds a token-type (segment) table of that size (BERT: 2).")
        dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the summed embeddings.")

    class LayerOverride(_Section):
        layers: Union[str, list[int]] = Field(
            ..., description="A Python-style slice over layer indices ('0::2') or a list [0, 5, 7]."
        )
        attention: Annotated[Attention | None, _PARTIAL] = Field(None, description="Merged over the stack's attention.")
        cross_attention: Annotated[Attention | None, _PARTIAL] = Field(
            None, description="Merged over the stack's cross-attention."
        )
        ffn: Annotated[FFN | None, _PARTIAL] = Field(
            None, description="Merged over the stack's ffn; a different type replaces it (hybrids)."
        )
        norm: Annotated[Norm | None, _PARTIAL] = Field(None, description="Merged over the stack's norm.")
        dropout: float | None = Field(None, ge=0, lt=1, description="This layer's sub-layer dropout.")

    class StackConfig(_Section):
        n_layers: int = Field(..., ge=1, description="Number of layers in the stack.")
        attention: Attention = Field(..., description="Self-attention of every layer.")
        cross_attention: Attention | None = Field(
            None,
            description="Decoder of an encoder-decoder: attention over the encoder's output; "
            "fields merge over attention's; null means the same as attention (without its window).",
        )
        ffn: FFN = Field(default_factory=lambda: {"type": "mlp"}, description="The feed-forward block.")
        norm: Norm = Field(
            default_factory=lambda: {"type": "layernorm"}, description="The norm block and its placement."
        )
        final_norm: bool = Field(True, description="A norm after the last layer (pre-norm stacks have one).")
        dropout: float = Field(0.0, ge=0, lt=1, description="On each sub-layer's output, before the residual add.")
        overrides: list[LayerOverride] = Field(
            default_factory=list, description="Layers that differ from the rest of the stack."
        )

        _spread = model_validator(mode="before")(_spread_stack_defaults)

        def layer_indices(self, override) -> list[int]:
            return parse_layers(override.layers, self.n_layers)

        def layer(self, index: int) -> LayerConfig:
            """Layer ``index``'s blocks, later overrides winning over earlier ones."""
            fields = {key: getattr(self, key) for key in LAYER_FIELDS}
            if fields["cross_attention"] is None:
                fields["cross_attention"] = self.attention.for_cross_attention()
            dropout = self.dropout
            for override in self.overrides:
                if index in self.layer_indices(override):
                    for key in LAYER_FIELDS:
                        if getattr(override, key) is not None:
                            fields[key] = getattr(override, key)
                    if override.dropout is not None:
                        dropout = override.dropout
            return LayerConfig(dropout=dropout, **fields)

        def layers(self) -> list[LayerConfig]:
            return [self.layer(i) for i in range(self.n_layers)]

    class ModelSpec(_Section):
        """A Transformer, declared. Attribute names are the YAML keys."""

        name: str = Field("model", description="Free text, shown in reports.")
        extends: Union[str, None] = Field(
            None, description="A spec this one overrides (path relative to this file)."
        )
        architecture: Architecture = Field(  # type: ignore[valid-type]
            ..., description="decoder-only | encoder-only | encoder-decoder."
        )
        vocab_size: int = Field(..., ge=1, description="Number of token ids.")
        d_model: int = Field(..., ge=1, description="Width of the residual stream.")
        max_seq_len: int = Field(..., ge=1, description="Longest sequence the model is built for.")
        tie_embeddings: bool = Field(False, description="Output projection shares the input embedding matrix.")
        share_encoder_decoder_embeddings: bool = Field(
            True, description="encoder-decoder only: one table for source and target."
        )
        embedding: EmbeddingConfig = Field(default_factory=EmbeddingConfig, description="Token embeddings.")
        position: Position = Field(  # type: ignore[valid-type]
            default_factory=lambda: {"type": "rope"},
            description="sinusoidal | learned | rope | alibi | relative_bias | none, with its knobs.",
        )
        decoder: StackConfig | None = Field(
            None, description="The causal stack of decoder-only and encoder-decoder models."
        )
        encoder: StackConfig | None = Field(
            None, description="The bidirectional stack of encoder-only and encoder-decoder models."
        )
        head: Head = Field(  # type: ignore[valid-type]
            default_factory=lambda: {"type": "lm"}, description="lm | mlm | classification | none."
        )

        @model_validator(mode="after")
        def _rules(self):
            problems = rule_errors(self)
            if problems:
                raise SpecRuleError(problems)
            return self

        @property
        def architecture_config(self):
            return registry.config_class("stack", self.architecture)()

        def stacks(self) -> dict[str, Any]:
            """The stacks this architecture runs, by name, in order."""
            return {name: getattr(self, name) for name in self.architecture_config.stacks}

    ModelSpec.__name__ = ModelSpec.__qualname__ = "ModelSpec"
    return ModelSpec


def rule_errors(spec) -> list[tuple[Loc, str]]:
    """Cross-field rules over a spec whose fields are each valid on their own.

    The rules of a block kind live with its blocks (``problems``, ``attention_problems``; see
    ``blocks.configs.base``); here they are asked, and their locations placed in the spec.
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
    return problems


def _at(loc: Loc, problems: list[tuple[Loc, str]]) -> list[tuple[Loc, str]]:
    """A block's problems (located within the block) located within the spec."""
    return [(loc + tuple(where), message) for where, message in problems]


def _stack_rules(spec, name: str, stack, cross_allowed: bool) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    attentions: list[tuple[Loc, Any]] = [((name, "attention"), stack.attention)]
    if stack.cross_attention is not None:
        attentions.append(((name, "cross_attention"), stack.cross_attention))
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
