"""Weight initialisation, GPT-2 style, seeded per parameter so any shard can be drawn alone.

* linear and embedding weights: normal(0, 0.02); biases: 0;
* norm scales: 1 (0 for RMSNorm with ``unit_offset``, whose scale is ``1 + weight``);
  LayerNorm biases: 0;
* residual projections (attention ``out_proj`` and the FFN ``down_proj``, inside MoE experts
  too): normal(0, 0.02 / sqrt(2 * n_layers)), ``n_layers`` of the stack they sit in (GPT-2).
* learned position tables and T5's relative-bias table: normal(0, 0.02).

A model may carry ``init_scales`` (``{parameter name: factor}``): those parameters' normal std is
multiplied by the factor (the builder sets it from the spec's ``parametrization``: muP's
``1 / sqrt(width ratio)`` on hidden matrices), in a whole build and shard by shard alike.

A block module with parameters of its own (not inside an ``nn.Linear`` or ``nn.Embedding``
child) declares how to fill them in ``init_rules(std) -> {name: rule}`` (norms, learned tables),
a rule being ``("normal", std)``, ``("uniform", bound)`` (from ``-bound`` to ``bound``) or
``("constant", value)``. Values that follow from other weights (DoRA's magnitude, the norm of
the weight it adapts) are set after every rule, by each module's ``init_from_weights()``
(:func:`init_from_weights`; again whenever the weights change: a checkpoint's, ``init_from``'s).
A module that initialises itself in
an ``init_weights(std)`` method instead (a plugin's) is called as it is; its values are then not
reproducible shard by shard (see :func:`imperative_modules`).

The random values of a parameter are a pure function of ``(seed, its name, the row)``: rows are
drawn in fixed blocks (:func:`row_block`), each from its own generator seeded by
``(seed, name, block index)``. So a rank that holds rows ``a..b`` of a sharded parameter draws
only the blocks that cover them (:func:`fill`) and gets exactly the values a whole-model build
has there: a sharded start on the meta device equals the single-process start bit for bit.
Nothing is done for meta tensors.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

STD = 0.02
RESIDUAL_PROJECTIONS = ("out_proj", "down_proj")
#: about this many values per generator block (whole rows; a row longer than this is one block)
BLOCK_VALUES = 1 << 16
#: name parts that wrappers insert (torch.compile, activation checkpointing, FSDP1); not in the model's own names
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")

Rule = tuple[str, float]


def canonical_name(name: str) -> str:
    """A parameter's name as the built model has it, wrappers' inserted parts taken out."""
    for part in _WRAPPERS:
        name = name.replace(part, "")
    return name


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def init_rules(model: nn.Module, std: float = STD) -> dict[str, Rule]:
    """``{parameter name: rule}`` for every parameter a declared rule covers (a module with an
    imperative ``init_weights`` has none: :func:`imperative_modules`)."""
    rules: dict[str, Rule] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Linear):
            rules[_join(prefix, "weight")] = ("normal", std)
            if module.bias is not None:
                rules[_join(prefix, "bias")] = ("constant", 0.0)
        elif isinstance(module, nn.Embedding):
            rules[_join(prefix, "weight")] = ("normal", std)
        elif callable(getattr(module, "init_rules", None)):
            rules.update({_join(prefix, name): rule for name, rule in module.init_rules(std).items()})
    stacks = model.stacks() if hasattr(model, "stacks") else {}
    for stack_name, stack in stacks.items():
        residual_std = std / math.sqrt(2 * stack.stack_layers)  # the whole stack's (a pipeline stage holds some)
        for name, module in stack.layers.named_modules(prefix=f"{stack_name}.layers"):
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS:
                rules[f"{name}.weight"] = ("normal", residual_std)
    scales = getattr(model, "init_scales", None) or {}
    rules = {canonical_name(k): v for k, v in rules.items()}
    for name, factor in scales.items():
        if name in rules and rules[name][0] == "normal":
            rules[name] = ("normal", rules[name][1] * factor)
    return rules


def imperative_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that initialise their own tensors in ``init_weights(std)`` rather than declaring
    rules: their values come from torch's global generator, not from the per-parameter seed."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if not isinstance(m, (nn.Linear, nn.Embedding))
        and not callable(getattr(m, "init_rules", None))
        and callable(getattr(m, "init_weights", None))
    ]


def row_block(shape: tuple[int, ...]) -> int:
    """Rows per generator block of a parameter of ``shape`` (a function of the shape alone)."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_VALUES // max(row, 1))


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def fill(
    out: torch.Tensor, rule: Rule, seed: int, name: str, shape: tuple[int, ...], offset: tuple[int, ...] | None = None
) -> None:
    """Write into ``out`` the slice at ``offset`` (default: the origin) of the initial value of
    parameter ``name`` whose whole shape is ``shape``. Values are drawn in fp32 and cast."""
    kind, value = rule
    if kind == "constant":
        out.fill_(value)
        return
    if kind not in ("normal", "uniform"):
        raise ValueError(f"{name}: unknown init rule {kind!r}; normal, uniform or constant")
    offset = tuple(offset) if offset is not None else (0,) * len(shape)
    if out.numel() == 0:
        return
    rows = row_block(shape)
    first, last = offset[0], offset[0] + out.shape[0]  # global rows held in `out`
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:]))
    for block in range(first // rows, (last - 1) // rows + 1):
        lo, hi = block * rows, min((block + 1) * rows, shape[0])
        generator = torch.Generator().manual_seed(_block_seed(seed, name, block))
        values = torch.empty((hi - lo, *shape[1:]), dtype=torch.float32)
        if kind == "normal":
            values.normal_(0.0, value, generator=generator)
        else:
            values.uniform_(-value, value, generator=generator)
        a, b = max(lo, first), min(hi, last)
        out[a - first : b - first].copy_(values[(slice(a - lo, b - lo), *rest)])


@torch.no_grad()
def init_weights(model: nn.Module, std: float = STD, seed: int | None = None) -> nn.Module:
    """Initialise every parameter of a built (not meta) model, or of a block built on its own,
    in place. ``seed``: the init seed (default: drawn from torch's global generator, so
    ``torch.manual_seed`` decides it)."""
    if any(p.is_meta for p in model.parameters()):
        return model
    if seed is None:
        seed = draw_seed()
    for _, module in imperative_modules(model):
        module.init_weights(std)
    rules = init_rules(model, std)
    for name, param in model.named_parameters():
        key = canonical_name(name)
        if key in rules:
            fill(param.data, rules[key], seed, key, tuple(param.shape))
    init_from_weights(model)
    return model


@torch.no_grad()
def init_from_weights(model: nn.Module) -> None:
    """Values that follow from the weights as they are now (DoRA's magnitude: the norm of the
    weight it adapts), set by each module's ``init_from_weights()``: after the rules, and again
    after weights are loaded into the model."""
    for module in model.modules():
        hook = getattr(module, "init_from_weights", None)
        if callable(hook):
            hook()


def draw_seed() -> int:
    """An init seed drawn from torch's global generator."""
    return int(torch.randint(0, 2**62, (), generator=torch.default_generator))
