"""What every block's config is, whatever its kind (torch-free): :class:`BlockConfig`, the base
of each kind's contract (``yamlformer.blocks.configs.base``), with what generic code may ask of
any block (its tensor-, context- and pipeline-parallel problems, its linear layers, its tensors'
classes); the types its rules speak in (``Loc``, ``Problems``, ``Shapes``), and the located
errors a config's validator raises (:func:`rule_error`, :func:`first_error`, :func:`indivisible`).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from yamlformer.blocks.configs.linear import LinearLayer, weight_layers
from yamlformer.blocks.configs.tensors import TensorClass

Loc = tuple[str | int, ...]
Problems = list[tuple[Loc, str]]
Shapes = dict[str, tuple[int, ...]]
#: a block's tensors by ``param_shapes`` name -> their class (``yamlformer.blocks.configs.tensors``)
Classes = dict[str, TensorClass]

#: tensor-parallel styles a block's ``parallel_plan()`` gives its submodules: ``colwise`` shards a
#: Linear's weight and bias on dim 0 (its output features); ``rowwise`` shards the weight on dim 1
#: (its input features), replicates the bias and sums the outputs; ``vocab`` shards a vocabulary
#: table or projection on dim 0 (its rows) with the outputs whole; ``replicate`` keeps the whole
#: tensor on every rank
PARALLEL_STYLES = ("colwise", "rowwise", "vocab", "replicate")


def rule_error(loc: Loc, message: str) -> PydanticCustomError:
    """What a config's own validator raises for a rule over its fields: the error carries the
    field it is about (``loc``, relative to the config), so the loader points at its line.
    ``raise rule_error(("top_k",), "top_k (3) cannot exceed n_experts (2)")``."""
    return PydanticCustomError("located_rule", "{message}", {"message": message, "loc": tuple(loc)})


class BlockConfig(BaseModel):
    """A block's own small config. Subclasses add ``type: Literal["name"] = "name"``.

    Each registered config counts what the block it describes builds (``params``: exact
    ``numel``; ``flops``: 2 per multiply-accumulate of every matrix product of one forward pass)
    beside the fields that decide the shapes, and lists ``examples`` (configs the registry-wide
    tests build, count, run and decode with).
    """

    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)

    kind: ClassVar[str]
    module_path: ClassVar[str]
    #: configs the registry-wide tests build and check (``tests/test_block_counts.py`` and others)
    examples: ClassVar[list[dict]] = []

    def describe(self) -> str:
        """A short label for per-layer tables (``describe``); the type name unless overridden."""
        return str(getattr(self, "type", type(self).__name__))

    def parallel_plan(self) -> dict[str, str] | None:
        """Tensor parallelism: submodule name (relative to the block's module) -> a style of
        :data:`PARALLEL_STYLES`; a submodule it does not name is replicated. None: no plan,
        replicated. A module whose plan splits its heads adapts to its share in
        ``use_tensor_parallel(rank, degree)`` (``yamlformer.recipes.parallel.tensor`` applies the plans)."""
        return None

    def tensor_parallel_problems(self, degree: int, d_model: int) -> Problems:
        """Why this block cannot be split ``degree`` ways by its plan: ``(field path relative to
        this config, message)`` pairs; none by default."""
        return []

    def context_parallel_problems(self, degree: int) -> Problems:
        """Why this block cannot run its share of a sequence split between ``degree``
        context-parallel ranks as its module implements it: ``(field path, message)`` pairs; none
        for a block that mixes no tokens (attention and heads with layers of their own say)."""
        return []

    def pipeline_parallel_problems(self, degree: int) -> Problems:
        """Why this block cannot sit in one pipeline stage of ``degree`` as its module runs there:
        ``(field path, message)`` pairs; none by default (a head with layers of its own says)."""
        return []

    def linear_layers(self, shapes: Shapes) -> dict[str, LinearLayer]:
        """The linear layers among this block's parameters (``shapes``: its ``param_shapes``), by module
        name, the layers a spec's ``adapters`` may adapt: by default every 2-D or stacked 3-D weight
        (:func:`~yamlformer.blocks.configs.linear.weight_layers`); a block whose module keeps a 2-D
        weight of another kind (a router: a plain ``nn.Linear``) leaves it out here."""
        return weight_layers(shapes)

    def tensor_parallel(self, degree: int, d_model: int) -> BlockConfig:
        """This block as each of ``degree`` tensor-parallel ranks holds and runs it: a config of
        the same type whose counts (``params``, FLOPs, saved bytes, KV cache) are one rank's
        share under :meth:`parallel_plan` (``yamlformer.builder.analysis.layout`` sizes activations with it). Only
        asked when :meth:`tensor_parallel_problems` is empty; a replicated block is itself."""
        return self

    # Each kind also declares ``param_shapes(...)`` (the same arguments as its ``params``): every
    # parameter tensor its module creates, named relative to the module as ``named_parameters()``
    # names it, with its shape. ``yamlformer.builder.analysis.layout`` shards them tensor by tensor. Abstract for
    # attention, FFN and norm blocks; positions and heads without parameters inherit ``{}``.

    def tensor_classes(self, *dims) -> Classes | None:
        """The class of every tensor ``param_shapes(*dims)`` names (input-like, hidden or
        output-like, and the widths its sides span: ``yamlformer.blocks.configs.tensors``), by the same
        names; muP's factors and Muon's choice of matrices come from it. None: not declared (a
        plugin's block), which a muP spec and Muon refuse at the block; a block without
        parameters declares ``{}`` by default."""
        shapes = getattr(self, "param_shapes", None)
        return {} if shapes is not None and not shapes(*dims) else None


def first_error(exc: ValidationError) -> PydanticCustomError:
    """The first error of a nested block's validation as one located rule error."""
    errors = exc.errors()
    first = errors[0]
    loc, message = tuple(first["loc"]), first["msg"]
    if first["type"] == "located_rule":
        loc, message = loc + tuple(first["ctx"]["loc"]), first["ctx"]["message"]
    elif first["type"] == "extra_forbidden":
        loc, message = loc, f"unknown key {loc[-1]!r}"
    elif first["type"] == "missing":
        message = f"missing required field {loc[-1]!r}"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return rule_error(loc, message + more)


def indivisible(degree: int, **fields: int) -> Problems:
    """A problem for each field whose value ``degree`` does not divide (tensor parallelism)."""
    return [
        (
            (name,),
            f"{value} is not a multiple of the tensor-parallel degree {degree} (degrees that "
            f"divide it: {', '.join(str(d) for d in range(1, min(value, 64) + 1) if value % d == 0)})",
        )
        for name, value in fields.items()
        if value % degree
    ]
