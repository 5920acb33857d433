"""The optimizer a run trains with, built from the recipe's ``optimizer:`` (any registered kind,
``yamlformer.builder.optim``) and the spec's parametrization: the module asks :func:`build_optimizer`
and never names an optimizer. Each kind's torch class is :mod:`.torch_optimizers` (AdamW, SGD)
or :mod:`.muon`, each registered under its type (:func:`implements`, :mod:`.implementations`);
the learning-rate schedules are :mod:`.schedule`."""

from __future__ import annotations

import torch
from torch import nn

from yamlformer.blocks.configs.tensors import TensorScaling
from yamlformer.blocks.init import canonical_name
from yamlformer.builder.optim import OptimizerConfig, Trainable
from yamlformer.builder.parametrization import plan
from yamlformer.builder.spec.loader import read_merged
from yamlformer.builder.spec.problems import locate
from yamlformer.builder.spec.source import SpecError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.optim import muon, torch_optimizers  # each registers the types it builds
from yamlformer.recipes.optim.implementations import IMPLEMENTATIONS, implementation, implements

__all__ = [
    "IMPLEMENTATIONS",
    "OptimizerProblem",
    "build_optimizer",
    "check_optimizer",
    "embedding_tables",
    "implementation",
    "implements",
    "muon",
    "param_groups",
    "torch_optimizers",
    "trainables",
]


class OptimizerProblem(ValueError):
    """The recipe's optimizer cannot train this model: ``problems`` are ``(field path within the
    optimizer section, message)``, which the run locates in the recipe."""

    def __init__(self, problems: list[tuple[tuple, str]]):
        self.problems = problems
        super().__init__("; ".join(f"optimizer.{'.'.join(map(str, loc))}: {message}" for loc, message in problems))


def embedding_tables(model: nn.Module) -> set[int]:
    """The ids of the embedding tables' parameters (AdamW's rule leaves them undecayed): every
    ``nn.Embedding``'s, and any parameter under a module whose name says ``embed``."""
    ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        if any("embed" in part for part in name.split(".")[:-1]):
            ids.add(id(p))
    return ids


def trainables(model: nn.Module, spec=None) -> tuple[list[Trainable], list[nn.Parameter]]:
    """Every parameter that trains (``requires_grad``: frozen ones and an adapter's frozen base are
    left out), once however many names share it, as the optimizer's group rules see it: its
    role and width ratios from the spec's parametrization (``yamlformer.builder.parametrization.plan``;
    a tensor the spec does not create, an adapter's, counts as undeclared)."""
    spec = spec if spec is not None else getattr(model, "spec", None)
    tensors = plan(spec).tensors if spec is not None else {}
    tables = embedding_tables(model)
    out, params, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        key = canonical_name(name)
        scaling = tensors.get(key)
        shape = tuple(p.shape)
        out.append(
            Trainable(key, shape, scaling or TensorScaling(None, ndim=len(shape)), id(p) in tables, key in tensors)
        )
        params.append(p)
    return out, params


def param_groups(optimizer: OptimizerConfig, model: nn.Module, spec=None) -> list[dict]:
    """The torch parameter groups ``optimizer`` declares for ``model``'s trainable parameters."""
    found, params = trainables(model, spec)
    problems = optimizer.problems(found)
    if problems:
        raise OptimizerProblem(problems)
    return [{"params": [params[i] for i in group.members], **group.settings} for group in optimizer.groups(found)]


def check_optimizer(optimizer: OptimizerConfig, model: nn.Module, recipe_file=None, spec=None) -> None:
    """Refuse, before any step, an optimizer that cannot train ``model`` (Muon with no hidden matrix
    to train): each problem located at the recipe's ``optimizer`` field it is about (the recipe's
    own line; ``--set``'s where the value came from there)."""
    problems = optimizer.problems(trainables(model, spec)[0])
    if not problems:
        return
    if recipe_file is None:
        raise RecipeError(str(OptimizerProblem(problems)))
    doc = read_merged(recipe_file)  # read on a refusal only
    raise SpecError([locate(doc, ("optimizer", *loc), message) for loc, message in problems])


def build_optimizer(optimizer: OptimizerConfig, model: nn.Module, spec=None) -> torch.optim.Optimizer:
    """The torch optimizer of a registered kind, over the groups it declares."""
    return implementation(optimizer)(optimizer, param_groups(optimizer, model, spec))
