"""The built-in optimizers: AdamW (the default), Muon with AdamW beside it, SGD (torch-free).

Their torch side is ``yamlformer.recipes.optim``, which registers itself under each type. Learning-rate
multipliers come from the spec's parametrization (``yamlformer.builder.parametrization``): every ratio
is 1 under the standard one, so each group's learning rate is then the recipe's, exactly.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from yamlformer.blocks.configs.block import rule_error
from yamlformer.builder.optim.registry import Group, OptimizerConfig, StateBytes, Trainable, grouped, register

#: a YAML list [0.9, 0.95] is the tuple; its items stay strictly typed
Beta = Annotated[float, Field(ge=0, lt=1)]


def _list_to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def adam_multiplier(t: Trainable) -> float:
    """muP's factor on an Adam learning rate (Tensor Programs V, table 3 with the output
    multiplier): ``1 / fan_in ratio`` on hidden tensors, 1 elsewhere."""
    return 1.0 / t.scaling.fan_in if t.role == "hidden" else 1.0


def matrix(t: Trainable) -> bool:
    """What Muon trains: a hidden matrix, or a stack of them (experts)."""
    return t.role == "hidden" and len(t.shape) >= 2


#: AdamW keeps two fp32 moments per element and an fp32 step per tensor
ADAMW_STATE = StateBytes(per_element=8, per_tensor=4)


class _AdamFields(OptimizerConfig):
    """AdamW's fields (its own, and Muon's for the tensors it does not orthogonalise)."""

    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="AdamW eps.")
    weight_decay: float = Field(
        0.1, ge=0, description="Decoupled weight decay on matrices; none on norms, biases and embeddings."
    )
    decay_embeddings: bool = Field(
        False, description="Decay the embedding tables too (nanoGPT and GPT-2's training do)."
    )
    _betas_tuple = field_validator("betas", mode="before")(_list_to_tuple)

    def decays(self, t: Trainable) -> bool:
        """AdamW's rule: decay on weight matrices; none on norms, biases and (unless
        ``decay_embeddings``) embedding tables."""
        return len(t.shape) >= 2 and (self.decay_embeddings or not t.table)

    def adam_settings(self, t: Trainable, lr: float, order: int) -> tuple[int, dict[str, Any]]:
        decay = self.decays(t)
        return order + (0 if decay else 1), {
            "lr": lr * adam_multiplier(t),
            "weight_decay": self.weight_decay if decay else 0.0,
        }


@register
class AdamWConfig(_AdamFields):
    """AdamW (Loshchilov & Hutter 2019), fused where torch has a kernel for the parameters."""

    type: Literal["adamw"] = Field("adamw", description="adamw (the default) | muon | sgd | a plugin's.")
    lr: float = Field(1e-3, gt=0, description="AdamW peak learning rate.")

    @property
    def peak_lr(self) -> float:
        return self.lr

    def groups(self, params: list[Trainable]) -> list[Group]:
        # the decayed group first, then the rest: as every AdamW checkpoint has them
        always = [(0, {"lr": self.lr, "weight_decay": self.weight_decay}), (1, {"lr": self.lr, "weight_decay": 0.0})]
        return grouped((self.adam_settings(t, self.lr, 0) for t in params), always)

    def state(self, role: str | None, ndim: int) -> StateBytes:
        return ADAMW_STATE


@register
class SGDConfig(OptimizerConfig):
    """Stochastic gradient descent with momentum (torch.optim.SGD, multi-tensor)."""

    type: Literal["sgd"] = Field("sgd", description="adamw (the default) | muon | sgd | a plugin's.")
    lr: float = Field(0.1, gt=0, description="SGD peak learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="Momentum (0: none, no state kept).")
    nesterov: bool = Field(False, description="Nesterov momentum (needs momentum > 0).")
    weight_decay: float = Field(
        0.0, ge=0, description="L2 penalty on matrices (added to the gradient, as torch's SGD does)."
    )
    decay_embeddings: bool = Field(False, description="Decay the embedding tables too.")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self):
        """Refused where the recipe loads (validate and the dry run too: the run alone refused it)."""
        if self.nesterov and self.momentum == 0:
            raise rule_error(("nesterov",), "Nesterov momentum needs momentum > 0")
        return self

    @property
    def peak_lr(self) -> float:
        return self.lr

    def multiplier(self, t: Trainable) -> float:
        """muP's factor on an SGD learning rate (Tensor Programs V, table 3, as Microsoft's MuSGD
        takes it with the output multiplier): fan_out on input-like tensors, fan_out / fan_in on
        hidden ones, fan_in on output-like ones."""
        s = t.scaling
        return {"input": s.fan_out, "hidden": s.fan_out / s.fan_in, "output": s.fan_in}.get(t.role, 1.0)

    def groups(self, params: list[Trainable]) -> list[Group]:
        def settings(t: Trainable) -> tuple[int, dict[str, Any]]:
            decay = len(t.shape) >= 2 and (self.decay_embeddings or not t.table)
            return (0 if decay else 1), {
                "lr": self.lr * self.multiplier(t),
                "weight_decay": self.weight_decay if decay else 0.0,
            }

        return grouped(settings(t) for t in params)

    def state(self, role: str | None, ndim: int) -> StateBytes:
        return StateBytes(per_element=4 if self.momentum > 0 else 0)

    def problems(self, params: list[Trainable]) -> list[tuple[tuple, str]]:
        if self.nesterov and self.momentum == 0:
            return [(("nesterov",), "Nesterov momentum needs momentum > 0")]
        return []


def muon_adjustment(shape: tuple[float, ...], how: str) -> float:
    """Muon's factor on its learning rate for a matrix of ``shape`` (its last two dims ``A x B``),
    as ``torch.optim.Muon`` names them: ``original`` (Keller Jordan's ``sqrt(max(1, A / B))``) or
    ``match_rms_adamw`` (Moonshot's ``0.2 * sqrt(max(A, B))``, an update as large as AdamW's)."""
    rows, cols = shape[-2], shape[-1]
    if how == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


@register
class MuonConfig(_AdamFields):
    """Muon (Jordan et al. 2024) on the hidden matrices the blocks declare (attention and FFN
    weights, experts included: each expert's matrix on its own), AdamW on the rest (embeddings,
    the output projection, norms, biases), in one optimizer with one state."""

    type: Literal["muon"] = Field("muon", description="adamw (the default) | muon | sgd | a plugin's.")
    lr: float = Field(0.02, gt=0, description="Muon's peak learning rate on the hidden matrices.")
    momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum.")
    nesterov: bool = Field(True, description="Nesterov momentum (Keller Jordan's default).")
    ns_steps: int = Field(5, ge=1, le=20, description="Newton-Schulz iterations orthogonalising each update.")
    ns_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="The Newton-Schulz iterations' dtype: bf16 (the reference's) | fp32 | auto: bf16 on a GPU, "
        "fp32 on a CPU (whose bf16 matmuls are emulated, ~10x slower).",
    )
    adjust_lr: Literal["original", "match_rms_adamw"] = Field(
        "original",
        description="Muon's per-shape factor on lr: original (sqrt(max(1, rows/cols)), Keller Jordan) | "
        "match_rms_adamw (0.2 sqrt(max(rows, cols)), Moonshot: an update as large as AdamW's).",
    )
    adamw_lr: float = Field(3e-3, gt=0, description="AdamW's peak learning rate on every other tensor.")

    @property
    def peak_lr(self) -> float:
        return self.lr

    def multiplier(self, t: Trainable) -> float:
        """muP's factor on Muon's learning rate: the update's spectral norm held at
        ``sqrt(fan_out / fan_in)`` of the base's (Yang, Simon & Bernstein 2023), with the shape
        factor :func:`muon_adjustment` taken at the base shape. 1 at the base width."""
        s = t.scaling
        if s.fan_in == 1.0 and s.fan_out == 1.0:
            return 1.0
        base = (*t.shape[:-2], t.shape[-2] / s.fan_out, t.shape[-1] / s.fan_in)
        ratio = muon_adjustment(base, self.adjust_lr) / muon_adjustment(t.shape, self.adjust_lr)
        return math.sqrt(s.fan_out / s.fan_in) * ratio

    def groups(self, params: list[Trainable]) -> list[Group]:
        def settings(t: Trainable) -> tuple[int, dict[str, Any]]:
            if matrix(t):
                return 0, {"lr": self.lr * self.multiplier(t), "weight_decay": self.weight_decay, "muon": True}
            order, adam = self.adam_settings(t, self.adamw_lr, 1)
            return order, {**adam, "muon": False}

        return grouped(settings(t) for t in params)

    def state(self, role: str | None, ndim: int) -> StateBytes:
        # a momentum buffer per element of a hidden matrix; AdamW's for the rest
        return StateBytes(per_element=4) if role == "hidden" and ndim >= 2 else ADAMW_STATE

    def problems(self, params: list[Trainable]) -> list[tuple[tuple, str]]:
        undeclared = [t.name for t in params if t.role is None and t.in_spec and len(t.shape) >= 2]
        if undeclared:
            return [
                (
                    ("type",),
                    f"muon trains the hidden matrices the blocks declare; {len(undeclared)} matrices "
                    f"({', '.join(undeclared[:3])}{', ...' if len(undeclared) > 3 else ''}) come from a block that "
                    "declares no tensor classes (tensor_classes, blocks/README.md)",
                )
            ]
        if not any(matrix(t) for t in params):
            return [
                (
                    ("type",),
                    "muon trains 2-D hidden weights (attention and FFN matrices), and this model has none to "
                    "train (frozen, or a model of embeddings and heads only): use adamw",
                )
            ]
        return []

    def describe(self) -> str:
        return f"muon lr {self.lr:g} on hidden matrices, adamw lr {self.adamw_lr:g} on the rest"
