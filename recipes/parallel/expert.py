"""Expert parallelism (``trainer.expert_parallel``), the step of :func:`yamlformer.recipes.parallel.parallelize`
after tensor parallelism: every mixture-of-experts block that can split its routed experts (``moe``, ``deepseek_moe``)
(``use_expert_parallel(mesh)``, as attention declares ``use_tensor_parallel``) splits them over
the ``ep`` dimension of the mesh, and tokens travel to their experts by all-to-all
(``yamlformer.blocks.experts.dispatch``).

The ``ep`` ranks are borrowed from the FSDP shard group, as torchtitan and Megatron borrow them
(:mod:`.mesh`: ``ep`` is the context-parallel ranks and ``dp_shard_in_ep`` data-parallel ones):
the data-parallel ones still read different batches, so ``data.batch_size`` stays per
data-parallel rank, and the context-parallel ones other shares of the same sequences (a token's
expert does not care whose share it is). FSDP2 then shards each split block's experts over the
rest of the data-parallel ranks (``dp_replicate x dp_shard_mod_ep``, :mod:`.fsdp`), and the
dense parameters over all of them as without expert parallelism. An expert's gradient already
sums the contributions of every ``ep`` rank's tokens, so its reduction divides by the whole
data- and context-parallel degree (torchtitan's ``fsdp_gradient_divide_factor``), not by the
ranks it is reduced over. The router, the shared experts and the expert bias stay whole on every rank;
the bias moves by load statistics summed over every rank holding the block (``after_optimizer_step``;
under pipeline parallelism its stage's ranks), so every rank keeps the same bias.
"""

from __future__ import annotations

from torch import nn


def expert_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that split their routed experts (``use_expert_parallel``),
    multi-token-prediction layers included, in module order."""
    return [module for module in model.modules() if callable(getattr(module, "use_expert_parallel", None))]


def apply_expert_parallel(model: nn.Module, ep_mesh) -> list[nn.Module]:
    """Split every expert block's routed experts over the 1-D mesh ``ep_mesh`` (any device, meta
    included). Returns the submodules each block split (its stacked experts): FSDP2 shards them
    as their own units, over the data-parallel ranks outside ``ep``."""
    split: list[nn.Module] = []
    blocks = expert_blocks(model)
    if not blocks:
        raise ValueError(f"{model.spec.name} has no mixture-of-experts block that splits its experts")
    for block in blocks:
        split += block.use_expert_parallel(ep_mesh)
    return split
