"""Tensor parallelism from the blocks' own plans (``trainer.tensor_parallel``), the first step of
:func:`yamlformer.recipes.parallel.parallelize`.

Each block config declares how its module splits (``parallel_plan``: submodule -> style); this
module maps the style names to ``torch.distributed.tensor.parallel`` styles and applies them to
the built modules over the ``tp`` dimension of the mesh:

* ``colwise`` — ``ColwiseParallel``: a linear layer's output features split, its input whole;
  without a ``rowwise`` partner in the plan (the head's projection to the vocabulary) its
  output leaves the block gathered whole;
* ``rowwise`` — ``RowwiseParallel``: its input features split, the outputs summed (all-reduce);
* ``vocab`` — a vocabulary table (``nn.Embedding``: rows split, ``RowwiseParallel``);
* ``replicate`` — left whole on every rank (its gradients agree across the group, since its
  inputs do).

Blocks without a plan (norms, positions, mixture-of-experts for now) are replicated. A module
whose heads are split adapts in ``use_tensor_parallel(rank, degree)``. Tied tensors (a head tied
to its embedding) are split alike and tied again. ``fully_shard`` then shards the result over the
data-parallel ranks (2-D parameters, :mod:`yamlformer.recipes.parallel.fsdp`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from yamlformer.blocks.linear import AdaptedLayer
from yamlformer.builder.analysis.layout import EMBEDDING_PLAN


def styles(plan: dict[str, str], module: nn.Module) -> dict:
    """The ``ParallelStyle`` of each submodule a plan splits (replicated ones left out); a layer
    with an adapter (``yamlformer.blocks.linear``) splits its adapter's tensors alike (:func:`adapted`)."""

    paired = "rowwise" in plan.values()  # a colwise output is consumed split; else it leaves the block whole
    out = {}
    for name, kind in plan.items():
        if kind == "colwise":
            out[name] = ColwiseParallel() if paired else ColwiseParallel(output_layouts=Replicate())
        elif kind == "rowwise":
            out[name] = RowwiseParallel()
        elif kind == "vocab":
            vocab_table = isinstance(module.get_submodule(name), nn.Embedding)
            out[name] = (
                RowwiseParallel(input_layouts=Replicate())
                if vocab_table
                else ColwiseParallel(output_layouts=Replicate())
            )
        elif kind != "replicate":
            raise ValueError(f"unknown tensor-parallel style {kind!r}; one of colwise, rowwise, vocab, replicate")
        layer = module.get_submodule(name) if name in out else None
        if isinstance(layer, AdaptedLayer) and layer.adapter is not None:
            out[name] = adapted(out[name])
    return out


def adapted(style):
    """``style`` (torch's ``ColwiseParallel`` or ``RowwiseParallel``) for a linear layer with an
    adapter: the layer's weight and bias split as the style splits them, and each adapter tensor
    along the layer's split features (the output features column-wise, the input features
    row-wise; ``AdapterBlock.feature_dims``), or replicated: LoRA's ``B`` column-wise and ``A``
    row-wise are split, the other factor whole, so the adapter's path needs no communication the
    layer's own does not make (DTensor computes the rest)."""

    axis = 0 if isinstance(style, ColwiseParallel) else 1  # the feature the style splits: out or in

    class Adapted(type(style)):
        def _partition_linear_fn(self, name, module, device_mesh):
            if "adapter" not in module._modules:  # the adapter's own modules: split with their layer, below
                return
            adapter = module._modules.pop("adapter")  # torch's style splits the layer's own tensors only
            try:
                super()._partition_linear_fn(name, module, device_mesh)
            finally:
                module._modules["adapter"] = adapter
            for key, param in list(adapter.named_parameters(recurse=False)):
                dim = adapter.feature_dims.get(key, (None, None))[axis]
                placement = [Shard(dim % param.ndim)] if dim is not None else [Replicate()]
                split = distribute_tensor(param, device_mesh, placement, src_data_rank=self.src_data_rank)
                adapter.register_parameter(key, nn.Parameter(split, requires_grad=param.requires_grad))

    twin = Adapted.__new__(Adapted)
    twin.__dict__.update(style.__dict__)
    return twin


def planned_modules(model: nn.Module) -> list[tuple[dict[str, str], nn.Module]]:
    """``(plan, module)`` for every module a plan splits: each stack's token embedding (once when
    shared), each layer's attention, cross-attention and FFN, the head (those a pipeline stage holds)."""
    spec = model.spec
    found: list[tuple[dict[str, str], nn.Module]] = []
    embeddings: list[nn.Module] = []
    for name, stack in model.stacks().items():
        if stack.embedding is not None and all(stack.embedding is not e for e in embeddings):
            embeddings.append(stack.embedding)
            found.append((EMBEDDING_PLAN, stack.embedding))
        stack_spec = getattr(spec, name)
        for index, layer in stack.layers._modules.items():  # a pipeline stage's keep their stack's numbers
            config = stack_spec.layer(int(index))
            blocks = [(config.attention, layer.attention), (config.ffn, layer.ffn)]
            if layer.cross_attention is not None:
                blocks.append((config.cross_attention, layer.cross_attention))
            found += [(c.parallel_plan(), m) for c, m in blocks]
    if model.head is not None:  # None in a pipeline stage before the last
        found.append((spec.head.parallel_plan(), model.head))
    return [(plan, module) for plan, module in found if plan]


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """Split ``model`` (a ``build_model`` model, on any device, meta included) over ``tp_mesh``."""

    tied = _alias_groups(model)
    rank, degree = tp_mesh.get_local_rank(), tp_mesh.size()
    for plan, module in planned_modules(model):
        parallelize_module(module, tp_mesh, styles(plan, module))
        if hasattr(module, "use_tensor_parallel"):
            module.use_tensor_parallel(rank, degree)
    _tie_again(model, tied)
    return model


def _alias_groups(model: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _tie_again(model: nn.Module, groups: list[list[str]]) -> None:
    """Parameters that were one tensor before their modules were split are one again."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            other = model.get_parameter(name)
            if getattr(other, "placements", None) != getattr(param, "placements", None):
                raise ValueError(
                    f"{name} is tied to {first} but their plans split them differently "
                    f"({getattr(other, 'placements', None)} vs {getattr(param, 'placements', None)})"
                )
            setattr(model.get_submodule(owner), leaf, param)
