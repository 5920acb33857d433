"""How a spec's tensors scale with its width: the standard parametrization or muP (torch-free).

The spec's ``parametrization:`` is ``{type: standard}`` (the default: every factor 1) or
``{type: mup, base_d_model: 256, ...}``: maximal-update parametrization (Yang et al. 2022,
"Tensor Programs V"), so that the learning rate and init tuned at the base width hold at any
width. From each block's declared tensor classes (``yamlformer.blocks.configs.tensors``: input-like,
hidden, output-like, and the widths each side spans) and the width ratios ``m = width / base
width`` this module derives, per tensor and per module:

* **init**: a hidden tensor's normal std times ``1 / sqrt(m_in)`` (variance ``1 / fan_in`` from
  the base's); input- and output-like tensors keep theirs (``init_scales``, which
  ``yamlformer.blocks.init`` reads from the model, on one process or shard by shard);
* **learning rates**: ``ratios`` per tensor, which each optimizer turns into its own multiplier
  (AdamW: ``1 / m_in`` on hidden tensors; Muon: ``sqrt(m_out / m_in)`` with its shape adjustment
  held at the base's; ``yamlformer.builder.optim``);
* **attention**: every score times ``sqrt(base head width / head width)``, so the scale goes as
  ``1 / head_dim`` (``sqrt(base) / head_dim``) instead of ``1 / sqrt(head_dim)``
  (:func:`attention_for_build`, through the attention block's ``with_score_factor``);
* **output multiplier**: the input of each module holding an output-like tensor (the vocabulary
  projection, tied or not; a classifier; a router) times ``output_multiplier / m_in``
  (:attr:`Plan.output_multipliers`), as Microsoft's ``MuReadout`` does.

At the base width every ratio is 1 and nothing is changed, so a muP spec there trains bit for
bit as the standard one. Widths: ``d_model`` (everything that grows with the residual stream:
heads, latent ranks) at ``d_model / base_d_model``; an FFN's inner width at ``hidden /
base_hidden_dim`` (default: with ``d_model``); a head's at ``head width / base_head_dim``
(default: with ``d_model``, i.e. ``n_heads`` fixed as the width grows).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from yamlformer.blocks.configs.tensors import TensorScaling
from yamlformer.blocks.limits import MAX_FACTOR, MAX_WIDTH
from yamlformer.builder.tensors import model_tensors

Loc = tuple[str | int, ...]


class _Parametrization(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)


class StandardParametrization(_Parametrization):
    """Init and learning rates as written, whatever the width."""

    type: Literal["standard"] = Field("standard", description="standard | mup.")


class MuPParametrization(_Parametrization):
    """Maximal-update parametrization from a base width (module doc)."""

    type: Literal["mup"] = Field(..., description="standard | mup.")
    base_d_model: int = Field(
        ..., ge=1, le=MAX_WIDTH, description="The width the learning rate and init were tuned at (at most d_model)."
    )
    base_hidden_dim: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH,
        description="FFN inner width at the base (experts' too); null: it grows with d_model.",
    )
    base_head_dim: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH,
        description="Attention head width at the base (the width scores sum over); null: it grows with d_model "
        "(n_heads fixed). Give head_dim itself when widening adds heads.",
    )
    output_multiplier: float = Field(
        1.0, gt=0, le=MAX_FACTOR, description="The output layer's input multiplier at the base width (muP's alpha)."
    )


Parametrization = Annotated[StandardParametrization | MuPParametrization, Field(discriminator="type")]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the parametrization does to a built model (module doc)."""

    type: str
    tensors: dict[str, TensorScaling]
    output_multipliers: dict[str, float]
    widths: dict[str, float]

    def init_scales(self) -> dict[str, float]:
        """``{parameter name: factor on its init std}`` where it is not 1."""
        return {name: t.init_factor for name, t in self.tensors.items() if t.init_factor != 1.0}


def is_mup(spec) -> bool:
    return spec.parametrization.type == "mup"


def widths(spec) -> dict[str, float]:
    """The width ratios: ``d_model``, ``head`` (of the first stack's attention) and, where
    ``base_hidden_dim`` is given, each FFN's own (read from its tensors' shapes)."""
    if not is_mup(spec):
        return {"d_model": 1.0, "head": 1.0}
    p = spec.parametrization
    m = spec.d_model / p.base_d_model
    attention = next(iter(spec.stacks().values())).attention
    return {"d_model": m, "head": head_ratio(spec, attention)}


def head_ratio(spec, attention) -> float:
    p = spec.parametrization
    if not is_mup(spec):
        return 1.0
    if p.base_head_dim is None:
        return spec.d_model / p.base_d_model
    width = attention.score_head_dim(spec.d_model)
    return width / p.base_head_dim if width is not None else 1.0


def _ratio(spec, ratios: dict[str, float], axis: str | None, size: int) -> float:
    if axis is None or not is_mup(spec):
        return 1.0
    if axis == "ffn" and spec.parametrization.base_hidden_dim is not None:
        return size / spec.parametrization.base_hidden_dim
    return ratios["head" if axis == "head" else "d_model"]


def scaling(spec, cls, shape: tuple[int, ...], ratios: dict[str, float]) -> TensorScaling:
    """A tensor's :class:`TensorScaling` from its declared class and shape (a matrix's input side
    is its last dim, its output side the one before; a vector's is its only dim)."""
    if cls is None:
        return TensorScaling(None, ndim=len(shape))
    fan_in = _ratio(spec, ratios, cls.fan_in, shape[-1] if shape else 1)
    fan_out = _ratio(spec, ratios, cls.fan_out, (shape[-2] if len(shape) > 1 else shape[-1]) if shape else 1)
    return TensorScaling(cls.role, fan_in, fan_out, len(shape))


def plan(spec) -> Plan:
    """The spec's :class:`Plan`: every parameter tensor ``build_model`` creates (named as
    ``named_parameters()`` names it), and the modules whose input the output multiplier scales."""
    ratios = widths(spec)
    tensors = {t.name: scaling(spec, t.cls, t.shape, ratios) for t in model_tensors(spec)}
    outputs: dict[str, float] = {}
    if is_mup(spec):
        alpha = spec.parametrization.output_multiplier
        for name, t in tensors.items():
            if t.role == "output":
                outputs[name.rpartition(".")[0]] = alpha / t.fan_in
        tied = spec.tie_embeddings and type(spec.head).projects_to_vocab
        head = spec.head.tensor_classes(spec.d_model, spec.vocab_size, tied) or {}
        for name, cls in head.items():  # a tied projection's module, whose weight is the embedding's
            if cls.role == "output" and f"head.{name}" not in tensors:
                outputs[f"head.{name.rpartition('.')[0]}"] = alpha / _ratio(spec, ratios, cls.fan_in, spec.d_model)
        outputs = {module: factor for module, factor in outputs.items() if factor != 1.0}
    return Plan(spec.parametrization.type, tensors, outputs, ratios)


# -- what assembly builds -------------------------------------------------------------------------


def attention_for_build(spec, attention):
    """The attention block a layer is built with: under muP at another head width, its scores
    multiplied by ``sqrt(base / head width)``; else itself."""
    factor = head_ratio(spec, attention) ** -0.5
    if factor == 1.0:
        return attention
    return attention.with_score_factor(factor, spec.d_model)


def layer_for_build(spec, layer):
    """A stack's resolved layer (``yamlformer.blocks.configs.layer.LayerConfig``) with its attentions
    as :func:`attention_for_build` gives them."""
    if not is_mup(spec):
        return layer
    cross = layer.cross_attention
    return dataclasses.replace(
        layer,
        attention=attention_for_build(spec, layer.attention),
        cross_attention=attention_for_build(spec, cross) if cross is not None else None,
    )


def head_for_build(spec, head):
    """The head with the attention of its own layer (``layer_field``) as :func:`attention_for_build` gives it."""
    field = type(head).layer_field
    if field is None or not is_mup(spec):
        return head
    own = getattr(head, field)
    return head.model_copy(
        update={field: own.model_copy(update={"attention": attention_for_build(spec, own.attention)})}
    )


# -- rules ------------------------------------------------------------------------------------------


def _blocks(spec) -> list[tuple[Loc, Any, tuple]]:
    """``(where in the spec, block, the dimensions its counts take)`` of every block the spec names."""
    d = spec.d_model
    out: list[tuple[Loc, Any, tuple]] = []
    if spec.embedding.norm is not None:
        out.append((("embedding", "norm"), spec.embedding.norm, (d,)))
    heads = next(iter(spec.stacks().values())).attention.query_heads()
    out.append((("position",), spec.position, (d, heads, spec.max_seq_len)))
    for name, stack in spec.stacks().items():
        for key in ("attention", "cross_attention", "ffn", "norm"):
            if getattr(stack, key) is not None:
                out.append(((name, key), getattr(stack, key), (d,)))
        for i, override in enumerate(stack.overrides):
            for key in ("attention", "cross_attention", "ffn", "norm"):
                if getattr(override, key) is not None:
                    out.append(((name, "overrides", i, key), getattr(override, key), (d,)))
    tied = spec.tie_embeddings and type(spec.head).projects_to_vocab
    out.append((("head",), spec.head, (d, spec.vocab_size, tied)))
    return out


def _attentions(spec) -> list[tuple[Loc, Any]]:
    return [(loc, block) for loc, block, _ in _blocks(spec) if loc[-1] in ("attention", "cross_attention")]


def problems(spec) -> list[tuple[Loc, str]]:
    """Why the spec's parametrization cannot apply: a base width larger than the width, a block
    that declares no tensor classes (or, under muP, an attention that cannot rescale its
    scores). Each located at the field it is about."""
    if not is_mup(spec):
        return []
    p, found = spec.parametrization, []
    if p.base_d_model > spec.d_model:
        found.append(
            (
                ("parametrization", "base_d_model"),
                f"base_d_model ({p.base_d_model}) is larger than d_model ({spec.d_model}); muP scales up from "
                "the base width: give the width the hyperparameters were tuned at, at most d_model",
            )
        )
    for loc, block, dims in _blocks(spec):
        if block.tensor_classes(*dims) is None:
            kind = getattr(block, "type", type(block).__name__)
            found.append(
                (
                    loc + ("type",),
                    f"{kind} declares no tensor classes (tensor_classes: which tensors are input-like, hidden, "
                    "output-like), which muP needs; declare them (blocks/README.md) or use parametrization: "
                    "{type: standard}",
                )
            )
    for loc, attention in _attentions(spec):
        width = attention.score_head_dim(spec.d_model)
        kind = getattr(attention, "type", type(attention).__name__)
        if width is None or attention.with_score_factor(1.0, spec.d_model) is None:
            found.append((loc + ("type",), f"{kind} attention does not say how to scale its scores, which muP needs"))
        elif p.base_head_dim is not None and p.base_head_dim > width:
            found.append(
                (
                    ("parametrization", "base_head_dim"),
                    f"base_head_dim ({p.base_head_dim}) is larger than the head width {width} of "
                    f"{'.'.join(map(str, loc))}; give the head width at the base, at most {width}",
                )
            )
    if p.base_hidden_dim is not None and not found:
        narrowest = min(_ffn_widths(spec), default=None)
        if narrowest is not None and p.base_hidden_dim > narrowest:
            found.append(
                (
                    ("parametrization", "base_hidden_dim"),
                    f"base_hidden_dim ({p.base_hidden_dim}) is larger than an FFN's inner width ({narrowest}); "
                    f"give the inner width at the base, at most {narrowest}",
                )
            )
    return found


def _ffn_widths(spec) -> set[int]:
    """The inner widths the spec's FFN tensors span (their ``ffn`` sides)."""
    sizes = set()
    for t in model_tensors(spec):
        if t.cls is not None and "ffn" in (t.cls.fan_in, t.cls.fan_out):
            sizes.add(t.shape[-1] if t.cls.fan_in == "ffn" else t.shape[-2] if len(t.shape) > 1 else t.shape[-1])
    return sizes


def describe_lines(spec) -> list[str]:
    """The parametrization as ``describe`` prints it: the width ratios, and under muP the
    attention factor, the output multipliers and each role's init factor."""
    if not is_mup(spec):
        return ["parametrization: standard (init and learning rates as written at every width)"]
    p, made = spec.parametrization, plan(spec)
    lines = [
        f"parametrization: mup from base_d_model {p.base_d_model} (width ratio {made.widths['d_model']:g}, "
        f"head ratio {made.widths['head']:g})"
    ]
    attention = next(iter(spec.stacks().values())).attention
    lines.append(f"  attention scores x {head_ratio(spec, attention) ** -0.5:.4g} (scale ~ 1/head_dim)")
    outputs = ", ".join(f"{m} x {f:.4g}" for m, f in sorted(made.output_multipliers.items())[:4])
    more = len(made.output_multipliers) - 4
    lines.append(f"  output multipliers: {outputs or 'none (base width)'}" + (f" and {more} more" if more > 0 else ""))
    hidden = [t for t in made.tensors.values() if t.role == "hidden"]
    if hidden:
        ins = sorted({round(t.fan_in, 6) for t in hidden})
        lines.append(
            "  hidden matrices: init std x "
            + ", ".join(f"{r**-0.5:.4g}" for r in ins)
            + "; AdamW lr x "
            + ", ".join(f"{1 / r:.4g}" for r in ins)
        )
    return lines


def summary(spec) -> dict[str, Any]:
    """The parametrization for ``describe --json`` and ``diff --json``: the spec's section, the width
    ratios, and under muP the attention factor, the output multipliers and the hidden tensors' factors."""
    out: dict[str, Any] = {**spec.parametrization.model_dump(), "widths": widths(spec)}
    if is_mup(spec):
        made = plan(spec)
        attention = next(iter(spec.stacks().values())).attention
        hidden = sorted({round(t.fan_in, 9) for t in made.tensors.values() if t.role == "hidden"})
        out.update(
            attention_score_factor=head_ratio(spec, attention) ** -0.5,
            output_multipliers=made.output_multipliers,
            hidden_init_factors=[r**-0.5 for r in hidden],
            hidden_adamw_lr_factors=[1 / r for r in hidden],
        )
    return out
