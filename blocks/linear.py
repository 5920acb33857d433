"""The linear layer every block is built of, and the one place a spec's ``adapters`` act on it.

Every projection of every block (attention's q/k/v/out, MLA's low-rank projections, FFN and GLU,
each stack of experts, the heads' projections) is a :class:`Linear`, or for stacked experts its
subclass :class:`yamlformer.blocks.experts.StackedLinear`. It is an ``nn.Linear``: its parameters are
``weight`` and ``bias``, initialised and split (tensor parallelism, FSDP) as any linear layer's, so
a block built on it names and counts nothing new. What the seam adds, for fine-tuning:

* :meth:`Linear.attach` an adapter (``yamlformer.blocks.adapters``: LoRA, DoRA, or a plugin's
  registered ``adapter`` block): a child module ``adapter`` whose forward takes the layer's input
  and output, ``y = adapter(x, linear(x), linear)``; its parameters are ``<path>.adapter.*``;
* :meth:`Linear.quantize` the frozen base weight to NF4 (QLoRA; ``torchao``'s ``NF4Tensor``, whose
  ``F.linear`` dequantizes block by block), a parameter that no longer trains;
* :meth:`Linear.adapted_weight`: the weight with the adapter folded in (what a merged export
  writes, and what MLA's absorbed decoding path multiplies by);
* :func:`adapters_disabled`: the model computes as its base for a while, every adapter skipped
  (preference tuning's reference model, without a second copy of the weights; PEFT's
  ``disable_adapter``).

An adapter computes through the layer's own :meth:`Linear.project` (a plain ``F.linear`` here, a
grouped matmul over each expert's rows for stacked experts) and :meth:`Linear.scale_outputs`, so
one adapter class serves a single projection and a stack of experts alike.

The two sides of that seam are written down as :class:`typing.Protocol` s, as PEFT's
``LoraVariant`` writes what a LoRA variant (DoRA, aLoRA...) gives the layer it varies (``init``,
``forward(module, x, result)``, ``merge_safe``/``unmerge``): :class:`Adapter`, what a layer asks of
the adapter attached to it, and :class:`AdaptedLayer`, what an adapter may ask of its layer. The
layer and the code that attaches adapters (``yamlformer.builder.assemble``, tensor parallelism) ask
these, never an adapter's class or whether it happens to have a method.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from yamlformer.blocks.configs.adapters import NF4_BLOCK, nf4_scaler_block


@runtime_checkable
class Adapter(Protocol):
    """What a linear layer asks of the adapter attached to it (``yamlformer.blocks.adapters``: LoRA,
    DoRA; a plugin's registered ``adapter`` block), built as ``Adapter(config, layer)``."""

    #: tensor name -> ``(output-feature dim, input-feature dim)``, each None when that tensor does
    #: not run along those features: how tensor parallelism splits it with its layer (the config's)
    feature_dims: dict[str, tuple[int | None, int | None]]

    def forward(self, x: torch.Tensor, y: torch.Tensor, linear: AdaptedLayer, **where) -> torch.Tensor:
        """The adapted output, from the layer's input ``x`` and its own output ``y`` (``where``: what
        the layer's :meth:`AdaptedLayer.project` needs besides, stacked experts' row counts)."""

    def merged_weight(self, linear: AdaptedLayer) -> torch.Tensor:
        """The layer's weight with this adapter folded in, shaped as the layer's weight."""

    def set_from_weight(self, linear: AdaptedLayer) -> None:
        """Set again what derives from the layer's weight (DoRA's magnitude; nothing for LoRA),
        after the weights change (init, a checkpoint's, ``init_from``'s)."""

    def init_rules(self, std: float) -> dict[str, tuple[str, float]]:
        """How ``yamlformer.blocks.init`` fills each of its tensors (``{name: (rule, value)}``)."""


@runtime_checkable
class AdaptedLayer(Protocol):
    """What an adapter may ask of the layer it adapts (:class:`Linear`, and stacked experts'
    ``yamlformer.blocks.experts.StackedLinear``): its tensors and how it computes with them."""

    weight: torch.Tensor  # (out, in); stacked: (n, out, in)
    bias: torch.Tensor | None

    @property
    def adapter(self) -> Adapter | None:
        """The attached adapter, or None."""

    def attach(self, adapter: Adapter) -> None:
        """Make ``adapter`` this layer's."""

    def project(self, x: torch.Tensor, weight: torch.Tensor, **where) -> torch.Tensor:
        """``x`` through a weight shaped as this layer's (an adapter's factor), no bias."""

    def base(self, x: torch.Tensor, **where) -> torch.Tensor:
        """This layer's own projection of ``x`` without its bias."""

    def scale_outputs(self, y: torch.Tensor, scale: torch.Tensor, **where) -> torch.Tensor:
        """``y`` times ``scale``, one factor per output feature."""

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The part of one of its tensors (or an adapter's) this layer computes with."""

    def dense_weight(self) -> torch.Tensor:
        """The weight in its compute dtype (an NF4 weight dequantized)."""


def missing(contract: type, obj: object) -> list[str]:
    """The members of the protocol ``contract`` that ``obj`` lacks (empty: it keeps the contract)."""
    members = {n for n in vars(contract) if not n.startswith("_")} | set(vars(contract).get("__annotations__", {}))
    return sorted(name for name in members if not hasattr(obj, name))


class Linear(nn.Linear):
    """``nn.Linear`` through which every block builds its projections (module doc). It draws no
    default values on the meta device, where there are none to draw (a meta build of 128 experts x
    48 layers otherwise spends seconds in meta ``uniform_``); elsewhere ``nn.Linear``'s draw, until
    ``yamlformer.blocks.init`` runs."""

    quantized: bool = False  # quantize() made the weight an NF4 tensor
    adapter_off: bool = False  # adapters_disabled(): the adapter is skipped

    @property
    def adapter(self) -> Adapter | None:
        """The attached adapter (a child module, :meth:`attach`), or None (none attached, or
        :func:`adapters_disabled` in force: every path that asks computes the base)."""
        return None if self.adapter_off else self._modules.get("adapter")

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # an NF4 weight dequantizes inside (torchao)
        return y if self.adapter is None else self.adapter(x, y, self)

    # -- what an adapter computes with -----------------------------------------------------------

    def project(self, x: torch.Tensor, weight: torch.Tensor, **where) -> torch.Tensor:
        """``x`` ``(..., in)`` through a weight shaped as this layer's, ``(out, in)`` (an adapter's
        factor: ``(r, in)``, ``(out, r)``), no bias."""
        return F.linear(x, weight)

    def base(self, x: torch.Tensor, **where) -> torch.Tensor:
        """This layer's own projection of ``x`` without its bias (DoRA's base on a dropped-out input)."""
        return self.project(x, self.weight, **where)

    def scale_outputs(self, y: torch.Tensor, scale: torch.Tensor, **where) -> torch.Tensor:
        """``y`` ``(..., out)`` times ``scale`` ``(out,)``, one factor per output feature."""
        return y * scale

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The part of one of its tensors (or an adapter's) this layer computes with: all of it
        (stacked experts split over ranks: this rank's experts)."""
        return t

    def dense_weight(self) -> torch.Tensor:
        """The weight in its compute dtype: an NF4 weight dequantized, any other as it is."""
        return self.weight.to(self.weight.dtype)  # NF4Tensor.to(dtype) dequantizes; a tensor stays itself

    def adapted_weight(self) -> torch.Tensor:
        """The weight this layer applies: the base with the adapter's change folded in."""
        if self.adapter is None:
            return self.dense_weight()
        return self.adapter.merged_weight(self)

    # -- what a spec's adapters do to it ---------------------------------------------------------

    def attach(self, adapter: Adapter) -> None:
        """Make ``adapter`` this layer's (``y = adapter(x, y, self)`` after the projection); one
        that does not keep the :class:`Adapter` contract is refused, naming what it lacks."""
        if not isinstance(adapter, nn.Module) or not isinstance(adapter, Adapter):
            lacks = missing(Adapter, adapter) or ["being an nn.Module"]
            raise TypeError(
                f"{type(adapter).__module__}.{type(adapter).__qualname__} is not an adapter "
                f"(yamlformer.blocks.linear.Adapter): it lacks {', '.join(lacks)}"
            )
        self._modules["adapter"] = adapter  # (add_module refuses the name the property holds)

    def init_from_weights(self) -> None:
        """An adapter's values that derive from the base weight (DoRA's magnitude), set again
        from the weight as it is now (after init, a checkpoint's or ``init_from``'s weights)."""
        if self.adapter is not None:
            self.adapter.set_from_weight(self)

    def quantize(self) -> None:
        """The base weight as torchao's NF4 (QLoRA's 4-bit NormalFloat: blocks of 64 values with a
        scale each, the scales double-quantized; ``yamlformer.blocks.configs.adapters.nf4_bytes``
        counts what it keeps), frozen."""
        to_nf4 = nf4_quantizer()
        weight = self.weight.detach()
        blocks = weight.numel() // NF4_BLOCK
        self.weight = nn.Parameter(to_nf4(weight, NF4_BLOCK, nf4_scaler_block(blocks)), requires_grad=False)
        self.quantized = True


def nf4_quantizer():
    """torchao's ``to_nf4``, imported quietly (its import logs the optional CUDA extensions a CPU
    build lacks, and torch's pytree deprecation notes); ``ImportError`` saying what to install."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        # local: torchao is an optional extra (yamlformer[qlora]), loaded for an NF4 base only
        from torchao.quantization import to_nf4
    except ImportError as exc:
        raise ImportError(f"adapters.quantize: nf4 needs torchao ({exc}): pip install 'yamlformer[qlora]'") from None
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return to_nf4


def linear_layers(model: nn.Module) -> dict[str, Linear]:
    """Every :class:`Linear` of ``model`` by its path (``decoder.layers.0.attention.q_proj``)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, Linear)}


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of every adapter attached to a layer of ``model``, by name."""
    out = {}
    for path, linear in linear_layers(model).items():
        if linear.adapter is not None:
            out.update((f"{path}.adapter.{name}", p) for name, p in linear.adapter.named_parameters())
    return out


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within it, every adapted layer of ``model`` computes its base projection alone: the model
    is the base it was adapted from (module doc)."""
    adapted = [linear for linear in linear_layers(model).values() if linear.adapter is not None]
    for linear in adapted:
        linear.adapter_off = True
    try:
        yield
    finally:
        for linear in adapted:
            linear.adapter_off = False
