"""Which linear layers a spec's ``adapters`` adapt (torch-free): every linear layer of the model by
the path ``build_model`` gives its module (from each block's ``linear_layers``), and the targets
resolved against them. The spec's rules (located problems: a target that names no layer, with the
nearest that do), the estimates and assembly all read this one resolution.

A target is a dotted path of module names: it selects every linear layer at or under the module
it names. Each part is a name, a layer index, a range of indices (``0-3``, both ends included) or
``*``. A target that starts at the model's root (``decoder``, ``encoder``, ``head``, or ``*``) is
matched from there; any other from anywhere in a path, so ``q_proj`` is every ``q_proj`` and
``ffn`` every linear layer of every FFN (PEFT's ``target_modules`` names). ``all-linear`` is every
linear layer of the stacks' layers.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from yamlformer.blocks.configs.adapters import ALL_LINEAR, NF4_BLOCK
from yamlformer.blocks.configs.base import Loc
from yamlformer.blocks.configs.linear import LinearLayer, plan_style

_RANGE = re.compile(r"(\d+)-(\d+)")
#: a layer index inside a path, folded to * when paths are listed as suggestions
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


@dataclasses.dataclass(frozen=True)
class SpecLinear:
    """One linear layer of a spec's model: its shapes, the tensor-parallel style its block's plan
    gives it, and whether it sits in a stack's layers (``all-linear``, ``quantize``) or the head."""

    layer: LinearLayer
    style: str
    in_layers: bool


def model_linears(spec) -> dict[str, SpecLinear]:
    """Every linear layer ``build_model(spec)`` makes, by module path, in model order; identical
    layers' blocks are asked once."""
    d = spec.d_model
    memory_of = spec.architecture_config.memory_of
    out: dict[str, SpecLinear] = {}
    for name, stack in spec.stacks().items():
        cross = name in memory_of
        by_index: dict[int, dict[str, SpecLinear]] = {}
        for indices, layer in stack.layer_groups():
            found = {}
            for sub in layer.sublayers(cross):
                found.update(_block_linears(getattr(layer, sub), f"{sub}.", d, in_layers=True))
            for index in indices:
                by_index[index] = found
        for index in sorted(by_index):
            out.update({f"{name}.layers.{index}.{path}": entry for path, entry in by_index[index].items()})
    head = spec.head
    shapes = head.param_shapes(d, spec.padded_vocab_size, False)  # a tied projection is still a linear layer
    for module, layer in head.linear_layers(shapes).items():
        out[f"head.{module}"] = SpecLinear(layer, plan_style(head.parallel_plan(), module), in_layers=False)
    return out


def _block_linears(block, prefix: str, d_model: int, in_layers: bool) -> dict[str, SpecLinear]:
    plan = block.parallel_plan()
    return {
        prefix + module: SpecLinear(layer, plan_style(plan, module), in_layers)
        for module, layer in block.linear_layers(block.param_shapes(d_model)).items()
    }


def adapted(spec) -> dict[str, SpecLinear]:
    """The linear layers ``spec.adapters`` adapts, by path (none without adapters). The spec is
    valid, so every target resolves (:func:`adapter_problems`)."""
    if spec.adapters is None:
        return {}
    return resolve(spec.adapters.targets, model_linears(spec))[0]


def quantized(spec) -> dict[str, SpecLinear]:
    """The linear layers whose base weight ``adapters.quantize`` stores as NF4: every 2-D layer of
    the stacks' layers (stacked experts and the head stay as they are)."""
    if spec.adapters is None or spec.adapters.quantize is None:
        return {}
    return {p: e for p, e in model_linears(spec).items() if e.in_layers and e.layer.stacked is None}


def resolve(targets, linears: dict[str, SpecLinear]) -> tuple[dict[str, SpecLinear], list[tuple[Loc, str]]]:
    """``(the layers the targets select, problems)``: a problem, located at ``("targets", i)``,
    for a target that selects none (naming the nearest paths that do) or a range past the
    indices there are."""
    if targets == ALL_LINEAR:
        return {p: e for p, e in linears.items() if e.in_layers}, []
    roots = {path.split(".")[0] for path in linears}
    split = {path: path.split(".") for path in linears}
    chosen: dict[str, SpecLinear] = {}
    problems: list[tuple[Loc, str]] = []
    for i, target in enumerate(targets):
        segments = target.split(".")
        anchored = segments[0] in roots or segments[0] == "*"
        hits = [p for p, parts in split.items() if _starts(segments, parts, anchored) is not None]
        if not hits:
            problems.append((("targets", i), f"{target!r} names no linear layer{_nearest(target, linears)}"))
            continue
        problems += [(("targets", i), message) for message in _ranges(target, segments, split, anchored)]
        chosen.update((p, linears[p]) for p in hits)
    return {p: e for p, e in linears.items() if p in chosen}, problems


def _matches(pattern: str, name: str) -> bool:
    if pattern == "*" or pattern == name:
        return True
    bounds = _RANGE.fullmatch(pattern)
    return bool(bounds and name.isdigit() and int(bounds[1]) <= int(name) <= int(bounds[2]))


def _starts(segments: list[str], parts: list[str], anchored: bool) -> int | None:
    """Where in ``parts`` (a linear layer's path) ``segments`` match a run of its modules (the
    layer itself or a module above it): 0 only when anchored; None where they do not."""
    for start in [0] if anchored else range(len(parts)):
        if len(segments) <= len(parts) - start and all(_matches(s, parts[start + k]) for k, s in enumerate(segments)):
            return start
    return None


def _ranges(target: str, segments: list[str], split: dict[str, list[str]], anchored: bool) -> list[str]:
    """A message for each range of ``target`` that reaches past the indices the model has there."""
    messages = []
    for k, segment in enumerate(segments):
        bounds = _RANGE.fullmatch(segment)
        if not bounds:
            continue
        head = segments[:k] + ["*"]
        present = set()
        for parts in split.values():
            start = _starts(head, parts, anchored)
            if start is not None and parts[start + k].isdigit():
                present.add(int(parts[start + k]))
        low, high = int(bounds[1]), int(bounds[2])  # high may be 10**12: the range is never built
        covered = high - low < len(present) and all(i in present for i in range(low, high + 1))
        if present and not covered:
            messages.append(f"{target!r}: {'.'.join(segments[:k])} has {min(present)}-{max(present)}, not {segment}")
    return messages


def _nearest(target: str, linears: dict[str, SpecLinear]) -> str:
    """``; nearest: a, b, c``: the module paths (layer indices folded to ``*``) closest to ``target``."""
    folded = list(dict.fromkeys(_INDEX.sub("*", path) for path in linears))
    candidates = set()
    for path in folded:
        parts = path.split(".")
        candidates.update(".".join(parts[a:b]) for a in range(len(parts)) for b in range(a + 1, len(parts) + 1))
    close = difflib.get_close_matches(target, sorted(candidates), n=3, cutoff=0.5)
    return f"; nearest: {', '.join(close or folded[:3])}"


def adapter_problems(spec) -> list[tuple[Loc, str]]:
    """The located problems of ``spec.adapters`` (relative to the spec): targets that select no
    linear layer or reach past its layers, and NF4 weights torchao cannot block."""
    if spec.adapters is None:
        return []
    linears = model_linears(spec)
    _, problems = resolve(spec.adapters.targets, linears)
    problems = [(("adapters", *loc), message) for loc, message in problems]
    if spec.adapters.quantize == "nf4":
        for path, entry in quantized(spec).items():
            n = entry.layer.out * entry.layer.in_
            if n % NF4_BLOCK:
                problems.append(
                    (
                        ("adapters", "quantize"),
                        f"{path} has {n:,} weights, not a multiple of NF4's blocks of {NF4_BLOCK}",
                    )
                )
                break
    return problems
