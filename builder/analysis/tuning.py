"""What trains under a spec's ``adapters`` (torch-free): each adapter's parameters, forward FLOPs and
saved bytes, layer by layer, and the bytes the frozen base keeps (an NF4 weight at what torchao
stores), for :func:`yamlformer.builder.analysis.estimates.estimate` and the per-rank accounting.
Without adapters everything trains."""

from __future__ import annotations

import dataclasses

from yamlformer.blocks.configs.adapters import nf4_bytes
from yamlformer.builder.adapters import adapted, quantized

Counts = tuple[int, int, int]  # (parameters, forward FLOPs of one sequence, bytes saved for backward)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The adapters' counts: per layer (``(stack, index)``) and the head's, and the layers whose
    base weights are NF4 (path -> elements)."""

    layers: dict[tuple[str, int], Counts]
    head: Counts
    nf4: dict[str, int]

    @property
    def params(self) -> int:
        """The adapters' parameters: what trains."""
        return sum(c[0] for c in self.layers.values()) + self.head[0]

    def frozen_bytes(self, frozen: int, act_bytes: int) -> int:
        """What ``frozen`` frozen elements keep: weights only, in the compute dtype, an NF4
        layer's at its real bytes."""
        quantized = sum(self.nf4.values())
        return (frozen - quantized) * act_bytes + sum(nf4_bytes(n, act_bytes) for n in self.nf4.values())


def tuning(spec, lengths: dict[str, int], batch: int, act_bytes: int) -> Tuning:
    """The adapters of ``spec`` over one step of ``batch`` sequences, each stack's of ``lengths[stack]``
    tokens (the head's: the last stack's)."""
    config = spec.adapters
    layers: dict[tuple[str, int], Counts] = {}
    head = (0, 0, 0)
    last = list(spec.stacks())[-1]
    for path, entry in adapted(spec).items():
        parts = path.split(".")
        tokens = lengths[parts[0] if parts[0] != "head" else last]
        counts = (
            config.params(entry.layer),
            config.flops(entry.layer, tokens),
            config.saved_bytes(entry.layer, batch * tokens, act_bytes),
        )
        if parts[0] == "head":
            head = _plus(head, counts)
        else:
            key = (parts[0], int(parts[2]))
            layers[key] = _plus(layers.get(key, (0, 0, 0)), counts)
    nf4 = {path: entry.layer.out * entry.layer.in_ for path, entry in quantized(spec).items()}
    return Tuning(layers, head, nf4)


def _plus(a: Counts, b: Counts) -> Counts:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])
