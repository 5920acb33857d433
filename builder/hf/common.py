"""What every Hugging Face family table is made of: tensor links, activation names, RoPE knobs.

A family (``yamlformer.builder.hf.decoders``, ``yamlformer.builder.hf.encoders``) says three things about one
``model_type``: how its ``config.json`` reads as a spec (``to_spec``), how a spec writes back
as that config (``to_config``), and which of its tensors is which of ours (``links``). A
:class:`Link` joins one or more Hugging Face tensors to one or more of ours with a conversion
each way (GPT-2's fused, transposed ``c_attn`` is one tensor here and three there), so import
and export read the same table. Nothing here imports torch at module level.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from yamlformer.builder.hf import names


class HFError(ValueError):
    """A Hugging Face folder, config or checkpoint that cannot be converted; says why."""


class Unsupported(HFError):
    """A config value or spec field the target cannot express exactly."""


def _identity(tensors):
    return list(tensors)


@dataclass(frozen=True)
class Link:
    """Hugging Face tensors ``hf`` hold what our tensors ``ours`` hold.

    ``to_ours`` maps the list of ``hf`` tensors to the list of ``ours`` tensors, ``to_hf`` the
    reverse; both default to a one-to-one copy.
    """

    hf: tuple[str, ...]
    ours: tuple[str, ...]
    to_ours: Callable[[list], list] = _identity
    to_hf: Callable[[list], list] = _identity


def same(hf: str, ours: str) -> Link:
    return Link((hf,), (ours,))


def transposed(hf: str, ours: str) -> Link:
    """GPT-2's ``Conv1D`` stores ``(in, out)``; ``nn.Linear`` stores ``(out, in)``."""
    flip = lambda ts: [t.t().contiguous() for t in ts]
    return Link((hf,), (ours,), flip, flip)


def split(hf: str, ours: Sequence[str], sizes: Sequence[int], dim: int = 0, transpose: bool = False) -> Link:
    """One fused Hugging Face tensor holds several of ours side by side along ``dim``.

    ``transpose`` first turns a ``Conv1D`` ``(in, out)`` weight into ``(out, in)``.
    """

    def to_ours(ts):
        t = ts[0].t() if transpose else ts[0]
        return [p.contiguous() for p in t.split(list(sizes), dim=dim)]

    def to_hf(ts):
        # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
        import torch

        t = torch.cat(ts, dim=dim)
        return [(t.t() if transpose else t).contiguous()]

    return Link((hf,), tuple(ours), to_ours, to_hf)


def stacked(hf: Sequence[str], our: str) -> Link:
    """One Hugging Face tensor per expert on disk, one ``(n_experts, ...)`` tensor here (our
    mixtures of experts stack their experts' weights)."""

    def to_ours(ts):
        # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
        import torch

        return [torch.stack(ts, dim=0)]

    return Link(tuple(hf), (our,), to_ours, lambda ts: [t.contiguous() for t in ts[0].unbind(0)])


@dataclass
class Family:
    """One Hugging Face ``model_type``: its config and tensor tables (see the module docstring).

    ``tied``: the output projection's tensor name, then the names the embedding it ties to
    may have on disk (the first present counts). ``ignored``: regexes of checkpoint tensors
    that carry nothing of ours (buffers Hugging Face recomputes, copies of a shared table);
    a tensor a link names is never ignored. ``needs``: config keys export cannot invent (token
    ids whose class default lies outside a small vocabulary). ``alternative_links``: another on-disk layout of
    some tensors (transformers 5.x's fused experts), used where its first names are present.
    ``start_from_pad``: the family's clients start the decoder from the token the tokenizer names
    pad (CTranslate2's Pegasus loader does), so an export names the decoder's start token so.
    """

    model_type: str
    hf_class: str  # the class named in config.json ``architectures``
    auto_class: str  # the transformers Auto class that loads it
    description: str
    tied: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    alternative_links: Callable[[Any], list[Link]] | None = field(default=None)
    start_from_pad: bool = False

    def classes(self, spec) -> tuple[str, str]:
        """``(hf_class, auto_class)`` of the model ``spec`` is (a family may have several heads)."""
        return self.hf_class, self.auto_class

    def to_spec(self, config: dict, names: set[str]) -> dict:
        raise NotImplementedError

    def to_config(self, spec) -> dict:
        raise NotImplementedError

    def links(self, spec) -> list[Link]:
        raise NotImplementedError

    def computed(self, spec) -> dict:
        """Tensors an export writes that hold nothing of ours: tables the family's classes would
        recompute (Marian's sinusoids), written so the folder loads without a missing-weights
        report. An import ignores them (``ignored``)."""
        return {}

    def is_ignored(self, name: str) -> bool:
        return any(re.fullmatch(pattern, name) for pattern in self.ignored)


# --- activations -------------------------------------------------------------------------

#: Hugging Face ``ACT2FN`` names with an exact counterpart among our activations
ACTIVATIONS_FROM_HF = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def activation_from_hf(name: str, where: str, aliases: dict[str, str] | None = None) -> str:
    name = (aliases or {}).get(name, name)
    try:
        return ACTIVATIONS_FROM_HF[name]
    except KeyError:
        known = ", ".join(sorted(ACTIVATIONS_FROM_HF))
        raise Unsupported(f"{where}: activation {name!r} has no counterpart here; supported: {known}") from None


def activation_to_hf(name: str, gelu_tanh: str) -> str:
    """Our activation as Hugging Face names it; ``gelu_tanh`` is the family's own spelling."""
    return gelu_tanh if name == "gelu_tanh" else name


# --- RoPE --------------------------------------------------------------------------------

#: Hugging Face ``rope_type`` -> our ``position.scaling.type`` (None: plain RoPE)
_ROPE_TYPES = {"default": None, "linear": "linear", "yarn": "yarn", "llama3": "llama3"}


def rope_from_hf(config: dict, default_theta: float, head_dim: int, mscale: bool = False) -> dict:
    """Our ``position:`` block from a config's ``rope_parameters`` (5.x) or ``rope_theta`` and
    ``rope_scaling`` (4.x). ``mscale``: the family's attention applies YaRN's ``mscale_all_dim``
    to the scores (DeepSeek's do; transformers' Llama-layout attentions do not)."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    theta = params.get("rope_theta", config.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise Unsupported(
            f"rope_type {kind!r} is not supported (exact counterparts: {', '.join(_ROPE_TYPES)}); "
            "'dynamic' rescales with the sequence length at run time, which a spec does not express"
        )
    position: dict[str, Any] = {"type": "rope", "theta": float(theta)}
    fraction = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if fraction is not None and fraction != 1.0:
        position["rotary_fraction"] = float(fraction)
    if _ROPE_TYPES[kind] is None:
        return position
    scaling: dict[str, Any] = {"type": _ROPE_TYPES[kind], "factor": float(params["factor"])}
    original = params.get("original_max_position_embeddings", config.get("max_position_embeddings"))
    if kind == "llama3":
        scaling.update(
            original_max_seq_len=int(original),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        )
    elif kind == "yarn":
        for knob in ("mscale", "mscale_all_dim"):
            if params.get(knob) is not None and not mscale:
                raise Unsupported(f"yarn with {knob} (DeepSeek's variant) has no counterpart in this family")
            if params.get(knob):  # 0 means unset to transformers
                scaling[knob] = float(params[knob])
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise HFError(f"rope_parameters.truncate: expected true or false, got {type(truncate).__name__}")
        if not truncate:
            scaling["truncate"] = False
        scaling.update(
            original_max_seq_len=int(original),
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
        )
        if params.get("attention_factor") is not None:
            scaling["attention_factor"] = float(params["attention_factor"])
    position["scaling"] = scaling
    return position


def rope_to_hf(position) -> dict:
    """``rope_theta`` and ``rope_scaling`` as both transformers 4.x and 5.x read them."""
    if position.type != "rope":
        raise Unsupported(f"position.type is {position.type!r}; this family uses rope")
    out: dict[str, Any] = {"rope_theta": position.theta, "rope_scaling": None}
    if position.rotary_fraction != 1.0:
        out["partial_rotary_factor"] = position.rotary_fraction
    scaling = position.scaling
    if scaling is None:
        return out
    if scaling.type == "ntk":
        raise Unsupported("rope scaling 'ntk' (static) has no Hugging Face rope_type; 'dynamic' differs")
    rope: dict[str, Any] = {"rope_type": scaling.type, "factor": scaling.factor}
    if scaling.type == "llama3":
        rope.update(
            original_max_position_embeddings=scaling.original_max_seq_len,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
        )
    elif scaling.type == "yarn":
        rope.update(
            original_max_position_embeddings=scaling.original_max_seq_len,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
        )
        if scaling.attention_factor is not None:
            rope["attention_factor"] = scaling.attention_factor
        if not scaling.truncate:
            rope["truncate"] = False
        for knob in ("mscale", "mscale_all_dim"):
            if getattr(scaling, knob) is not None:
                rope[knob] = getattr(scaling, knob)
    out["rope_scaling"] = rope
    return out


# --- small readers -----------------------------------------------------------------------


def need(config: dict, key: str, family: str):
    """A config key the family cannot default."""
    if config.get(key) is None:
        raise HFError(f"{family} config.json has no {key!r}")
    return config[key]


def dropout(value) -> float:
    return float(value or 0.0)


def windows_by_layer(stack) -> list[int | None]:
    """Each layer's self-attention sliding window, overrides applied."""
    return [stack.layer(i).attention.sliding_window for i in range(stack.n_layers)]


def window_overrides(windows: list[int | None]) -> tuple[int | None, list[dict]]:
    """The stack's own window and the overrides that give each layer its window."""
    values = set(windows)
    if len(values) == 1:
        return windows[0], []
    base = max(values, key=lambda w: (windows.count(w), w is None))
    overrides: list[dict] = []
    for value in sorted(values - {base}, key=lambda w: (w is None, w or 0)):
        layers = [i for i, w in enumerate(windows) if w == value]
        overrides.append({"layers": layers, "attention": {"sliding_window": value}})
    return base, overrides


def _interleaved_to_halves(n: int):
    """Index that turns interleaved rotary pairs ``(x0, x1), (x2, x3)...`` into halves
    ``(x0, x2, ..., x1, x3, ...)`` (``ours = hf[index]``)."""
    return list(range(0, n, 2)) + list(range(1, n, 2))


def permuted_rows(hf: str, our: str, blocks: int, width: int, start: int, rope: int) -> Link:
    """A weight (or bias) whose rows come in ``blocks`` blocks of ``width``, each with ``rope``
    rotary rows from ``start``: interleaved on disk, halves here (DeepSeek's and Llama 4's rotary q/k rows)."""
    import_index = [b * width + i for b in range(blocks) for i in range(width)]
    export_index = list(import_index)
    halves = _interleaved_to_halves(rope)
    for b in range(blocks):
        for j, source in enumerate(halves):
            import_index[b * width + start + j] = b * width + start + source
            export_index[b * width + start + source] = b * width + start + j

    def take(index):
        def convert(ts):
            # local: torch loads when weights are converted (builder.hf serves torch-free commands: list, describe)
            import torch

            return [t.index_select(0, torch.tensor(index, device=t.device)).contiguous() for t in ts]

        return convert

    return Link((hf,), (our,), take(import_index), take(export_index))


def decoder_links(
    spec,
    layer_links: Callable[[str, int, Any], list[Link]],
    *,
    embedding: str = "model.embed_tokens.weight",
    final_norm: Sequence[str] = ("model.norm.weight",),
    layers: str = "model.layers",
    head: str = "lm_head.weight",
) -> list[Link]:
    """A decoder-only family's tensor names: the token embedding and the final norm (``final_norm``:
    Hugging Face's names, ours by their last part: ``.weight``, ``.bias``), each layer's from
    ``layer_links(hf_prefix, index, layer_config)`` (``hf_prefix``: ``{layers}.{index}``), and the
    head unless the embedding is tied to it."""
    norm = names.final_norm("decoder")
    links = [same(embedding, names.token_embedding("decoder"))]
    links += [same(hf, f"{norm}.{hf.rpartition('.')[2]}") for hf in final_norm]
    for i in range(spec.decoder.n_layers):
        links += layer_links(f"{layers}.{i}", i, spec.decoder.layer(i))
    if not spec.tie_embeddings:
        links.append(same(head, names.head_projection()))
    return links
