"""What generic code knows of a block's linear layers (torch-free): their shapes
(:class:`LinearLayer`, from each config's ``linear_layers``) and the tensor-parallel style a
block's plan gives each (:func:`plan_style`); the layers a spec's ``adapters`` adapt
(``yamlformer.builder.adapters``) and the seam they are built through (``yamlformer.blocks.linear``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LinearLayer:
    """One linear layer of a block (:meth:`BlockConfig.linear_layers`): its weight's ``out`` and
    ``in_`` features; ``stacked``: the experts a stacked weight holds (None: one projection);
    ``rows``: the rows it multiplies per token of the block's input (a routed expert stack:
    ``top_k``, spread over its experts)."""

    out: int
    in_: int
    stacked: int | None = None
    rows: float = 1.0

    def weight_shape(self) -> tuple[int, ...]:
        return (self.out, self.in_) if self.stacked is None else (self.stacked, self.out, self.in_)


def weight_layers(shapes: dict[str, tuple[int, ...]]) -> dict[str, LinearLayer]:
    """Every ``<module>.weight`` among a block's ``param_shapes`` of 2 dims ``(out, in)``, or of 3
    ``(n, out, in)`` (one per expert, stacked), by module: each built as
    ``yamlformer.blocks.linear.Linear`` (stacked: ``StackedLinear``)."""
    out = {}
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module and len(shape) in (2, 3):
            out[module] = LinearLayer(*shape[-2:], stacked=shape[0] if len(shape) == 3 else None)
    return out


def plan_style(plan: dict[str, str] | None, module: str) -> str:
    """The style a block's ``parallel_plan`` gives its submodule ``module`` (``q_proj``; a plan
    entry covers the modules under it, the longest entry winning): ``replicate`` where none does."""
    keys = [k for k in (plan or {}) if module == k or module.startswith(k + ".")]
    return plan[max(keys, key=len)] if keys else "replicate"
