"""Starting a run from trained weights (``model.init_from``) and keeping parts of them fixed
(``model.freeze``), for every task.

``init_from`` names one of:

* a checkpoint of another run (``.ckpt`` from ``builder train``, a file or a sharded folder):
  its spec, weights and tokenizer (the recipe's ``tokenizer`` section is not used: the weights
  only mean something with the vocabulary they were trained on);
* a folder written by ``builder import-hf`` (``spec.yaml`` and ``model.safetensors``);
* a Hugging Face model folder (``config.json`` and ``*.safetensors``), converted on the fly;
* a recipe (a file, or a zoo recipe by name: ``lm-stdlib``): the last checkpoint of its run, where
  ``builder train`` writes it from this working directory (``runs/lm-stdlib/checkpoints/last.ckpt``),
  so one recipe fine-tunes what another trained.

Each is read (and a checkpoint verified) once per run, when the recipe is resolved
(:mod:`yamlformer.recipes.training.resolved`: the ``Run`` keeps the source); a checkpoint's
tokenizer is taken by :func:`yamlformer.recipes.trained.pretrained_tokenizer`.

Without ``model.spec`` the spec is the source's (``model.overrides`` still apply: dropout, a
longer ``max_seq_len``...). Every tensor must fit by name and shape; the first that does not is
named. The head is the exception: a task that brings its own head (classification on an MLM or
LM body) starts it fresh, and a head the task does not use is left out; both are reported. So
are adapters (``model.adapters``) the source has not: they start as the spec's adapters start
(the adapted model equals the source's), once the base weights are in (DoRA's magnitude is the
norm of the loaded weight).

``freeze`` lists parts of the model by dotted path, each matching every parameter under it:
``decoder.layers.0-3`` (a range of layer indices, both ends included), ``embedding`` (a path
may start below the stacks: it is tried under ``encoder`` and ``decoder``), ``*`` for any one
name (``decoder.layers.*.attention``). A frozen tensor gets no gradient and no optimizer state;
a tied head is frozen with its embedding.
"""

from __future__ import annotations

import difflib
import re

import torch
from torch import nn

from yamlformer.blocks.init import init_from_weights
from yamlformer.blocks.linear import adapter_parameters
from yamlformer.builder.hf.weights import alias_groups
from yamlformer.builder.init_from import Source
from yamlformer.builder.spec.source import Mark, Problem, SpecError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.recipe.init_from import init_from_errors

_RANGE = re.compile(r"(\d+)-(\d+)")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def load_pretrained(model: nn.Module, source: Source) -> dict[str, list[str]]:
    """Copy the source's tensors into ``model``, checking every name and shape first. Returns the
    head tensors started fresh (``new``) and the source's tensors left out (``unused``)."""

    with init_from_errors():
        state = source.state()
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in model.state_dict())
    adapters = set(adapter_parameters(model))
    plan, new = [], []
    for group in alias_groups(model):
        present = [n for n in group if n in state]
        head = all(n.startswith("head.") for n in group)
        if not present:
            if head or group[0] in adapters:
                new.append(group[0])
                continue
            raise RecipeError(
                f"model.init_from: {source.path} has no tensor {group[0]} (shape {_shape(own[group[0]])}); it was "
                "made for another architecture than this spec"
            )
        name, value = present[0], state[present[0]]
        if _shape(value) != _shape(own[group[0]]):
            if head:
                new.append(group[0])
                continue
            hint = ""
            if name.endswith("embedding.tokens.weight") and _shape(value)[0] != _shape(own[group[0]])[0]:
                hint = (
                    f"; the vocabulary differs (tokenizer {_shape(own[group[0]])[0]:,} tokens, the weights "
                    f"{_shape(value)[0]:,}): train with the tokenizer the weights were trained with"
                )
            raise RecipeError(
                f"model.init_from: {name} has shape {_shape(value)} in {source.path} but {_shape(own[group[0]])} "
                f"in this model{hint}"
            )
        plan.append((own[group[0]], value))
    unused = sorted(n for n in state if n not in own)
    wrong = [n for n in unused if not n.startswith("head.")]
    if wrong:
        raise RecipeError(
            f"model.init_from: {source.path} holds {wrong[0]}, which this model does not have "
            f"({len(wrong)} such tensors); use the spec it was trained with"
        )
    with torch.no_grad():
        for target, value in plan:
            target.copy_(value)  # into an NF4 base (QLoRA): quantized as it is copied
    init_from_weights(model)  # what follows from the weights now in (DoRA's magnitude)
    report = f"weights: {len(plan)} tensors from the {source.describe()} {source.path}"
    fresh = [n for n in new if n in adapters]
    if fresh:
        report += f"; adapters started fresh: {len(fresh)} tensors"
    new = [n for n in new if n not in adapters]
    if new:
        report += f"; new: {', '.join(new)}"
    if unused:
        report += f"; left out: {', '.join(unused)}"
    print(report, flush=True)
    return {"new": new, "unused": unused}


# -- freezing -------------------------------------------------------------------------------------


def _segment_matches(pattern: str, name: str) -> bool:
    if pattern == "*" or pattern == name:
        return True
    bounds = _RANGE.fullmatch(pattern)
    return bool(bounds and name.isdigit() and int(bounds[1]) <= int(name) <= int(bounds[2]))


def _matches(pattern: list[str], name: list[str]) -> bool:
    return len(pattern) <= len(name) and all(_segment_matches(p, n) for p, n in zip(pattern, name))


def _parts(model: nn.Module) -> list[str]:
    """The model's parts a freeze pattern can name (modules two levels deep, layers folded)."""
    names = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        parts = name.split(".")[:-1]
        for depth in (1, 2, 3):
            if len(parts) >= depth:
                names.add(".".join(parts[:depth]))
    return sorted(names)


def _layer_ranges(parts: list[str]) -> list[str]:
    folded: dict[str, list[int]] = {}
    rest = []
    for part in parts:
        head, _, last = part.rpartition(".")
        if last.isdigit():
            folded.setdefault(head, []).append(int(last))
        else:
            rest.append(part)
    return rest + [f"{head}.{min(ids)}-{max(ids)}" for head, ids in folded.items()]


def freeze(model: nn.Module, patterns: list[str], marks: list | None = None) -> int:
    """Set ``requires_grad=False`` on every parameter a pattern matches; returns the number of
    frozen parameters (elements). A pattern that matches nothing, or a range that reaches past
    the layers there are, is a located error (``marks[i]``: where pattern ``i`` was written)."""

    named = list(model.named_parameters(remove_duplicate=False))  # a tied head answers to its own name too
    roots = {name.split(".")[0] for name, _ in named}
    stacks = [s for s in ("encoder", "decoder") if s in roots]
    problems, chosen = [], {}
    for i, pattern in enumerate(patterns):
        segments = pattern.split(".")
        candidates = [segments] if segments[0] in roots or segments[0] == "*" else [[s, *segments] for s in stacks]
        hits = [(n, p) for n, p in named for c in candidates if _matches(c, n.split("."))]
        where = (marks[i] if marks and i < len(marks) and marks[i] else None) or Mark("<model.freeze>")
        if not hits:
            known = _layer_ranges(_parts(model))
            close = difflib.get_close_matches(pattern, known, n=1, cutoff=0.6)
            problems.append(
                Problem.at(
                    where,
                    f"model.freeze.{i}",
                    (
                        f"{pattern!r} names no part of the model"
                        + (f"; did you mean {close[0]!r}?" if close else "")
                        + f" (its parts: {', '.join(known[:12])}"
                        + (", ...)" if len(known) > 12 else ")")
                    ),
                )
            )
            continue
        for c in candidates:
            for k, segment in enumerate(c):
                bounds = _RANGE.fullmatch(segment)
                if not bounds:
                    continue
                present = {
                    int(n.split(".")[k])
                    for n, _ in named
                    if len(n.split(".")) > k
                    and n.split(".")[k].isdigit()
                    and _matches(c[:k] + ["*"], n.split(".")[: k + 1])
                }
                wanted = set(range(int(bounds[1]), int(bounds[2]) + 1))
                if present and not wanted <= present:
                    problems.append(
                        Problem.at(
                            where,
                            f"model.freeze.{i}",
                            (f"{pattern!r}: {'.'.join(c[:k])} has {min(present)}-{max(present)}, not {segment}"),
                        )
                    )
        chosen.update((id(p), p) for _, p in hits)
    if problems:
        raise SpecError(problems)
    if len(chosen) == len({id(p) for _, p in named}):
        raise RecipeError("model.freeze freezes every parameter: nothing would train")
    for p in chosen.values():
        p.requires_grad_(False)
    frozen = sum(p.numel() for p in chosen.values())
    total = sum(p.numel() for p in {id(p): p for _, p in named}.values())
    print(f"frozen: {frozen:,} of {total:,} parameters ({', '.join(patterns)})", flush=True)
    return frozen


def load_init_from(model: nn.Module, run) -> None:
    """The weights of ``run``'s ``model.init_from`` (a :class:`yamlformer.recipes.training.resolved.Run`:
    the source its resolution read), if it names some."""
    if run.source is not None:
        load_pretrained(model, run.source)


def freeze_parts(model: nn.Module, run) -> None:
    """``run``'s ``model.freeze``, if any, each problem at the line the resolution found it written."""
    patterns = list(run.recipe.model.freeze)
    if patterns:
        freeze(model, patterns, list(run.freeze_marks))
