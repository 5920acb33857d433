"""What each parameter tensor of a block is, for width-aware training (muP, Muon). Torch-free.

A block declares, beside ``param_shapes``, a :class:`TensorClass` for every tensor it creates
(``tensor_classes``, same arguments, same names): which of the three classes of Yang et al.
2022 ("Tensor Programs V", table 3) it belongs to, and which widths its two sides span.

* ``input``: one side grows with the width, the other does not (embedding tables, position
  tables) and every vector (biases, norm gains): init and Adam learning rate independent of width;
* ``hidden``: both sides grow (attention and FFN matrices, stacked experts): init variance and
  Adam learning rate ``1 / fan_in``; Muon trains these;
* ``output``: the input side grows, the output side does not (the vocabulary projection, a
  classifier, a router): its module's input is multiplied by ``1 / width ratio`` (muP's output
  multiplier, as Microsoft's ``MuReadout`` does), which keeps init and Adam learning rate fixed.

A side's width is an :data:`AXES` name: ``d_model`` (the residual stream and every width that
grows with it: attention heads, latent ranks), ``ffn`` (a feed-forward block's inner width),
``head`` (a per-head vector), or None (a fixed size: vocabulary, classes, experts, buckets).
``yamlformer.builder.parametrization`` turns the declarations and the spec's
``parametrization`` into per-tensor factors; the block never sees them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Role = Literal["input", "hidden", "output"]
#: the widths a tensor's side may span (None: a fixed size)
AXES = ("d_model", "ffn", "head")


@dataclasses.dataclass(frozen=True)
class TensorClass:
    """One tensor's class: its role and the widths its input (``fan_in``, a matrix's last dim)
    and output (``fan_out``: the dim before, a vector's only dim) sides span."""

    role: Role
    fan_in: str | None = None
    fan_out: str | None = None

    def __post_init__(self):
        for side in (self.fan_in, self.fan_out):
            if side is not None and side not in AXES:
                raise ValueError(f"a tensor side spans one of {', '.join(AXES)} or None, got {side!r}")


def vector(width: str | None = "d_model") -> TensorClass:
    """A bias, a norm gain, a per-head scalar: input-like, ``width`` wide."""
    return TensorClass("input", None, width)


def table(width: str | None = "d_model") -> TensorClass:
    """An embedding or position table: rows of a fixed count, ``width`` wide."""
    return TensorClass("input", None, width)


def hidden(fan_in: str = "d_model", fan_out: str = "d_model") -> TensorClass:
    """A matrix (or a stack of them) whose both sides grow with the width."""
    return TensorClass("hidden", fan_in, fan_out)


def output(fan_in: str = "d_model") -> TensorClass:
    """A projection from a growing width to a fixed one (logits, classes, a router's scores)."""
    return TensorClass("output", fan_in, None)


def prefixed(prefix: str, classes: dict[str, TensorClass]) -> dict[str, TensorClass]:
    """A nested block's classes under its module name (``norm.`` + ``weight``)."""
    return {f"{prefix}{name}": cls for name, cls in classes.items()}


def vocab_classes(name: str, bias: bool) -> dict[str, TensorClass]:
    """A vocabulary projection's classes: output-like, named even when tied (its module then
    reads the embedding table, which is counted and trained as the embedding's, and still takes
    muP's output multiplier)."""
    return {f"{name}.weight": output(), **({f"{name}.bias": vector(None)} if bias else {})}


@dataclasses.dataclass(frozen=True)
class TensorScaling:
    """One parameter tensor under a spec's parametrization (``yamlformer.builder.parametrization``): its role
    (None: its block declares no classes) and the width ratios of its input and output sides
    (1.0: a fixed size, or the standard parametrization)."""

    role: str | None
    fan_in: float = 1.0
    fan_out: float = 1.0
    ndim: int = 2

    @property
    def init_factor(self) -> float:
        """The factor on the normal std of its init."""
        return self.fan_in**-0.5 if self.role == "hidden" else 1.0
