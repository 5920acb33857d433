"""Per-layer Hugging Face configs as a stack and its ``overrides:``, and back.

Recent families vary their layers by lists in ``config.json`` (Gemma 3's and GPT-OSS's
``layer_types``, Llama 4's ``no_rope_layers`` and ``moe_layers``); a spec says the same with one
stack and overrides. :func:`stack_overrides` turns each layer's own fields into the stack's
(those the most layers share) and an override per other combination, naming only what differs;
:func:`layer_values` and :func:`uniform` read a spec's resolved layers back for ``to_config``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from yamlformer.builder.hf.common import HFError, Unsupported

#: the sub-layer sections a layer's fields are grouped in
SECTIONS = ("attention", "ffn")


def stack_overrides(layers: Sequence[dict[str, dict]]) -> tuple[dict[str, dict], list[dict]]:
    """``(the stack's sections, overrides)`` for ``layers``, each ``{"attention": {...}, "ffn":
    {...}}`` (a section may be absent: the same on every layer).

    The stack takes the combination the most layers have (the first of equals); an override per
    other combination lists its layers (a slice string when they are every n-th to the last)
    and, per section, the attention fields that differ (a null clears one) and the whole FFN
    when it differs (an FFN of another type replaces it)."""
    keys = [json.dumps(layer, sort_keys=True) for layer in layers]
    chosen: dict[str, list[int]] = {}  # each combination's layers, in the order they first appear
    for i, key in enumerate(keys):
        chosen.setdefault(key, []).append(i)
    base_key = max(chosen, key=lambda k: len(chosen[k]))  # the first of equals
    base = layers[chosen[base_key][0]]
    overrides = []
    for key, indices_ in chosen.items():
        if key == base_key:
            continue
        layer = layers[indices_[0]]
        override: dict[str, Any] = {"layers": _selection(indices_, len(keys))}
        for section, fields in layer.items():
            if section == "ffn":
                if fields != base.get("ffn"):
                    override["ffn"] = fields
                continue
            changed = {f: v for f, v in fields.items() if base.get(section, {}).get(f) != v}
            if changed:
                override[section] = changed
        overrides.append(override)
    return base, overrides


def _selection(chosen: list[int], n_layers: int) -> str | list[int]:
    """``"start::step"`` for every ``step``-th layer from ``start`` to the last (Gemma 3's global
    layers, Llama 4's NoPE ones), else the list of indices."""
    if len(chosen) >= 2:
        start, step = chosen[0], chosen[1] - chosen[0]
        if chosen == list(range(start, n_layers, step)):
            return f"{start}::{step}"
    return chosen


def layer_values(stack, read: Callable[[Any], Any]) -> list:
    """``read(layer)`` of each of ``stack``'s resolved layers."""
    return [read(stack.layer(i)) for i in range(stack.n_layers)]


def uniform(values: Sequence, what: str, family: str):
    """The one value every layer that has one shares (None when none has), or
    :class:`Unsupported` naming ``what``: a family's config takes one value for all of them."""
    present = {json.dumps(v, sort_keys=True) for v in values if v is not None}
    if len(present) > 1:
        raise Unsupported(f"{family} takes one {what} for every layer; the spec's layers have {sorted(present)}")
    return json.loads(present.pop()) if present else None


def flags(config: dict, key: str, n_layers: int, family: str) -> list[int] | None:
    """A per-layer list of 0/1 flags (``no_rope_layers``), None when absent, else one
    :class:`HFError` naming the key."""
    value = config.get(key)
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(type(v) in (int, bool) and v in (0, 1) for v in value):
        raise HFError(f"{key}: expected a list of 0 and 1, one per layer")
    if len(value) != n_layers:
        raise HFError(f"{key}: {len(value)} entries for num_hidden_layers {n_layers}")
    return [int(v) for v in value]


def indices(config: dict, key: str, n_layers: int) -> list[int] | None:
    """A list of layer indices (``moe_layers``), None when absent, else one :class:`HFError`."""
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v < n_layers for v in value):
        raise HFError(f"{key}: expected a list of layer indices from 0 to {n_layers - 1}")
    return sorted(set(value))


def layer_types(config: dict, n_layers: int, known: Sequence[str], family: str) -> list[str] | None:
    """``layer_types`` checked against ``known`` and the layer count; None when absent."""
    types = config.get("layer_types")
    if types is None:
        return None
    if len(types) != n_layers:
        raise HFError(f"layer_types has {len(types)} entries for num_hidden_layers {n_layers}")
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise Unsupported(f"{family}: layer types {unknown} are not supported (known: {', '.join(known)})")
    return list(types)


def whole_head_rope(position: dict, family: str) -> dict:
    """``position`` (a spec's, from ``rope_from_hf``), refused when it rotates part of each head:
    Gemma 3's, GPT-OSS's and Llama 4's rotations take the whole head whatever
    ``partial_rotary_factor`` says, so a fraction would not be what transformers computes."""
    if position.get("rotary_fraction", 1.0) != 1.0:
        raise Unsupported(
            f"{family}: partial_rotary_factor {position['rotary_fraction']}: transformers' {family} "
            "rotates the whole head"
        )
    return position
