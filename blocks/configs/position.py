"""Position configs: sinusoidal, learned, RoPE (with its scalings), ALiBi, T5 relative bias, none.

``params(d_model, n_heads, max_seq_len)`` counts what one stack's position block builds
(relative bias: one table per stack, shared by its layers).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from yamlformer.blocks.configs.base import BlockConfig, Classes, Loc, PositionBlock, Problems, Shapes, rule_error
from yamlformer.blocks.configs.tensors import table
from yamlformer.blocks.configs.traffic import Traffic, rotary
from yamlformer.blocks.limits import MAX_BUCKETS, MAX_FACTOR, MAX_SEQ_LEN
from yamlformer.blocks.registry import register


class _PositionConfig(PositionBlock):
    examples: ClassVar[list[dict]] = [{}]


@register("position", "yamlformer.blocks.positions:Sinusoidal")
class SinusoidalConfig(_PositionConfig):
    """Fixed sines and cosines added to the embeddings (Vaswani et al. 2017)."""

    type: Literal["sinusoidal"] = "sinusoidal"
    acts_on: ClassVar[str] = "embedding"
    layout: Literal["interleaved", "split"] = Field(
        "interleaved",
        description="interleaved: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...) (the "
        "paper); split: all the sines in the first half of the vector, the cosines in the second "
        "(tensor2tensor, fairseq, Marian).",
    )
    examples: ClassVar[list[dict]] = [{}, {"layout": "split"}]


@register("position", "yamlformer.blocks.positions:Learned")
class LearnedConfig(_PositionConfig):
    """A learned table of absolute position embeddings (GPT-2, BERT)."""

    type: Literal["learned"] = "learned"
    acts_on: ClassVar[str] = "embedding"
    max_positions: int | None = Field(
        None, ge=1, le=MAX_SEQ_LEN, description="Rows of the table; defaults to max_seq_len and may not be shorter."
    )
    examples: ClassVar[list[dict]] = [{}, {"max_positions": 40}]

    def params(self, d_model: int, n_heads: int, max_seq_len: int) -> int:
        return (self.max_positions or max_seq_len) * d_model

    def param_shapes(self, d_model: int, n_heads: int, max_seq_len: int) -> Shapes:
        return {"weight": (self.max_positions or max_seq_len, d_model)}

    def tensor_classes(self, d_model: int, n_heads: int, max_seq_len: int) -> Classes:
        return {"weight": table()}

    def problems(self, d_model: int, max_seq_len: int) -> Problems:
        if self.max_positions is not None and self.max_positions < max_seq_len:
            return [
                (
                    ("max_positions",),
                    f"learned table of {self.max_positions} positions is shorter than max_seq_len ({max_seq_len})",
                )
            ]
        return []


class _RopeScaling(BlockConfig):
    factor: float = Field(..., gt=0, le=MAX_FACTOR, description="How many times longer the context becomes.")


class LinearScaling(_RopeScaling):
    """Position interpolation (Chen et al. 2023): positions divided by ``factor``."""

    type: Literal["linear"] = "linear"


class NTKScaling(_RopeScaling):
    """NTK-aware scaling: theta grows to theta * factor^(d / (d - 2))."""

    type: Literal["ntk"] = "ntk"


class YarnScaling(_RopeScaling):
    """YaRN (Peng et al. 2023): per-frequency interpolation ramp and attention temperature."""

    type: Literal["yarn"] = "yarn"
    original_max_seq_len: int = Field(..., ge=1, le=MAX_SEQ_LEN, description="The context the model was trained on.")
    beta_fast: float = Field(32.0, gt=0, le=MAX_FACTOR, description="Rotations above which frequencies are kept.")
    beta_slow: float = Field(1.0, gt=0, le=MAX_FACTOR, description="Rotations below which frequencies interpolate.")
    attention_factor: float | None = Field(
        None,
        gt=0,
        le=MAX_FACTOR,
        description="cos/sin multiplier; null means 0.1 * ln(factor) + 1, or with both mscale and "
        "mscale_all_dim set (0.1 * mscale * ln(factor) + 1) / (0.1 * mscale_all_dim * ln(factor) + 1).",
    )
    mscale: float | None = Field(
        None,
        gt=0,
        le=MAX_FACTOR,
        description="DeepSeek's YaRN: scales ln(factor) in the numerator of the default "
        "attention_factor (used only together with mscale_all_dim). null: unused.",
    )
    mscale_all_dim: float | None = Field(
        None,
        gt=0,
        le=MAX_FACTOR,
        description="DeepSeek's YaRN (V2, V3): every attention score is multiplied by "
        "(0.1 * mscale_all_dim * ln(factor) + 1)^2, the temperature applied to the whole of q.k "
        "instead of through the rotated part only; with mscale equal to it, cos and sin are "
        "left unscaled. null: unused.",
    )
    truncate: bool = Field(
        True,
        description="Round the ramp's ends to whole dimensions (floor and ceil, as the YaRN paper and "
        "Hugging Face's default do); false keeps them fractional (GPT-OSS).",
    )


class Llama3Scaling(_RopeScaling):
    """Llama 3.1's piecewise scaling of wavelengths between two thresholds."""

    type: Literal["llama3"] = "llama3"
    original_max_seq_len: int = Field(..., ge=1, le=MAX_SEQ_LEN, description="The context the model was trained on.")
    low_freq_factor: float = Field(1.0, gt=0, le=MAX_FACTOR, description="Wavelengths above original/low are scaled.")
    high_freq_factor: float = Field(4.0, gt=0, le=MAX_FACTOR, description="Wavelengths below original/high are kept.")

    @model_validator(mode="after")
    def _order(self):
        if self.high_freq_factor < self.low_freq_factor:  # equal: no smoothed band (Llama 4 Scout)
            raise rule_error(("high_freq_factor",), "high_freq_factor must be at least low_freq_factor")
        return self


RopeScaling = Annotated[LinearScaling | NTKScaling | YarnScaling | Llama3Scaling, Field(discriminator="type")]


@register("position", "yamlformer.blocks.positions:Rope")
class RopeConfig(_PositionConfig):
    """Rotary position embedding (Su et al. 2021) applied to queries and keys."""

    type: Literal["rope"] = "rope"
    rotates: ClassVar[bool] = True
    theta: float = Field(10000.0, gt=0, le=MAX_FACTOR, description="The base of the rotation frequencies.")
    rotary_fraction: float = Field(
        1.0, gt=0, le=1, description="Share of head_dim that rotates (GPT-NeoX/Phi use < 1)."
    )
    scaling: RopeScaling | None = Field(
        None, description="Context extension: {type: linear | ntk | yarn | llama3, factor, ...}."
    )

    examples: ClassVar[list[dict]] = [
        {},
        {"theta": 500000.0, "rotary_fraction": 0.5},
        {"scaling": {"type": "linear", "factor": 4.0}},
        {"scaling": {"type": "ntk", "factor": 2.0}},
        {"scaling": {"type": "yarn", "factor": 4.0, "original_max_seq_len": 8}},
        {"scaling": {"type": "yarn", "factor": 8.0, "original_max_seq_len": 16, "truncate": False}},
        {"scaling": {"type": "llama3", "factor": 8.0, "original_max_seq_len": 8}},
        {"scaling": {"type": "llama3", "factor": 16.0, "original_max_seq_len": 8, "high_freq_factor": 1.0}},
    ]

    def rotary_dim(self, head_dim: int) -> int:
        """The rotated width of a head whose rotary part is ``head_dim`` wide."""
        return int(head_dim * self.rotary_fraction)

    def traffic_per_layer(self, heads: int, rotary_head_dim: int, act_bytes: int) -> Traffic:
        return rotary(heads * self.rotary_dim(rotary_head_dim), act_bytes)

    def saved_bytes_per_layer(self, batch: int, seq: int, rotary_head_dim: int, act_bytes: int) -> int:
        # yamlformer.blocks.positions.Rope makes cos and sin (batch, 1, seq, rotary_dim) in every layer;
        # the multiplies with q and k keep them
        return 2 * batch * seq * self.rotary_dim(rotary_head_dim) * act_bytes

    def attention_problems(self, attention, *, d_model: int, stack_heads: int, at: Loc) -> Problems:
        head_dim = attention.rotary_head_dim(d_model)
        rotary = self.rotary_dim(head_dim)
        if rotary % 2:
            return super().attention_problems(attention, d_model=d_model, stack_heads=stack_heads, at=at) + [
                (
                    ("position", "rotary_fraction"),
                    f"rope needs an even rotary dimension; head_dim "
                    f"{head_dim} x rotary_fraction {self.rotary_fraction} = {rotary}",
                )
            ]
        return super().attention_problems(attention, d_model=d_model, stack_heads=stack_heads, at=at)


@register("position", "yamlformer.blocks.positions:Alibi")
class AlibiConfig(_PositionConfig):
    """ALiBi (Press et al. 2021): a per-head linear penalty on distance added to the scores."""

    type: Literal["alibi"] = "alibi"
    biases_scores: ClassVar[bool] = True
    examples: ClassVar[list[dict]] = [{}]  # no fields


@register("position", "yamlformer.blocks.positions:RelativeBias")
class RelativeBiasConfig(_PositionConfig):
    """T5's bucketed relative position bias: one learned table per stack, shared by its layers."""

    type: Literal["relative_bias"] = "relative_bias"
    biases_scores: ClassVar[bool] = True
    num_buckets: int = Field(32, ge=2, le=MAX_BUCKETS, description="Buckets of relative distance.")
    max_distance: int = Field(128, ge=1, le=MAX_SEQ_LEN, description="Distance beyond which buckets stop growing.")
    examples: ClassVar[list[dict]] = [{}, {"num_buckets": 8, "max_distance": 16}]

    def params(self, d_model: int, n_heads: int, max_seq_len: int) -> int:
        return self.num_buckets * n_heads

    def param_shapes(self, d_model: int, n_heads: int, max_seq_len: int) -> Shapes:
        return {"weight": (self.num_buckets, n_heads)}

    def tensor_classes(self, d_model: int, n_heads: int, max_seq_len: int) -> Classes:
        return {"weight": table(None)}  # buckets x heads: no side grows with the width

    def saved_bytes_per_stack(self, seq: int, n_heads: int, fused: bool) -> int:
        # the int64 bucket of every (query, key) pair, kept by the table lookup; a fused kernel
        # also keeps the fp32 (1, n_heads, seq, seq) bias, one tensor for every layer
        return seq * seq * 8 + (n_heads * seq * seq * 4 if fused else 0)

    def attention_problems(self, attention, *, d_model: int, stack_heads: int, at: Loc) -> Problems:
        problems = super().attention_problems(attention, d_model=d_model, stack_heads=stack_heads, at=at)
        heads = attention.query_heads()
        if heads != stack_heads:
            field = ("n_heads",) if "n_heads" in type(attention).model_fields else ()
            return problems + [
                (
                    at + field,
                    f"{heads} heads, but the stack's relative-bias table has {stack_heads}; "
                    "relative_bias needs the same n_heads in every layer of a stack",
                )
            ]
        return problems


@register("position", "yamlformer.blocks.positions:NoPosition")
class NoPositionConfig(_PositionConfig):
    """No position information (NoPE); a causal mask alone orders the tokens."""

    type: Literal["none"] = "none"
    examples: ClassVar[list[dict]] = [{}]  # no fields
