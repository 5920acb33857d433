"""Where every parameter lives under FSDP2 and tensor parallelism, exactly, per rank (torch-free).

A :class:`Layout` is the device mesh a recipe trains on: ``devices`` ranks on ``nodes``
machines, ``tensor_parallel`` ranks inside a node splitting each layer, ``pipeline_parallel``
stages holding consecutive layers, ``context_parallel`` ranks splitting each sequence (ring
attention), ``expert_parallel`` ranks splitting a mixture of experts' experts (borrowed from the
FSDP shard group, as torchtitan borrows them), the rest data-parallel —
``shard`` (FSDP2 full sharding over every data-parallel rank), ``hybrid`` (HSDP: shard inside a
node, replicate across nodes) or ``replicate`` — or, with ``strategy="ddp"``, every rank a
whole replica (DDP). Each parallelism is one field of it. Ranks are numbered as
``init_device_mesh(("pp", "replicate", "shard", "cp", "tp"))`` lays them out: tensor-parallel
ranks innermost (neighbours on one node), then context-parallel ranks, then the shard group,
then the replicas, then the pipeline stages. FSDP shards over the shard group and the
context-parallel ranks together (``shard_size``). :func:`layout_problems` names every field of a
spec (or the step's sequence) a layout cannot split; the rank accounting below
(:func:`rank_states`, :func:`sharded_memory`; expert parallelism counted exactly) is for layouts
without pipeline or context parallelism, which ``yamlformer.builder.analysis.perf`` sizes per stage.

What a rank holds, as PyTorch builds it:

* **Tensor parallelism** (DTensor). Each block declares ``parallel_plan()`` in its config
  (``blocks/configs``): ``colwise`` shards a Linear's weight and bias on dim 0, ``rowwise`` its
  weight on dim 1 (the bias replicated), ``vocab`` a vocabulary table or projection on dim 0
  (outputs whole); the rest is replicated. The token embedding is vocab-parallel; the head's
  projection splits the vocabulary and its logits are gathered whole (``yamlformer.recipes.parallel.tensor``).
  Every split must be even: heads, KV heads, FFN width and vocabulary divide by the degree, or
  :func:`tensor_parallel_problems` names the field.
* **FSDP2** (``fully_shard``, one unit per Transformer layer, one per embedding, one for the head
  and the root for the rest, a tied head and its embedding among them) shards every parameter —
  the tensor-parallel local tensor under TP —
  on dim 0 over the shard group as ``torch.chunk`` splits it: rank ``s`` of the group holds rows
  ``[s*c, (s+1)*c)`` of ``c = ceil(rows / group)``, so later ranks can hold fewer rows or none.
  Shard rank 0 holds the most, the last the least. FSDP2 pads each rank's parameter storage (and
  its flat gradient buffer) to rank 0's size.
* **Mixed precision** (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): the
  sharded parameters stay fp32 and are the optimizer's master weights (no second copy); each unit
  is all-gathered in bf16 for compute; its gradients are reduce-scattered in fp32 into fp32
  sharded gradients. The optimizer keeps what it declares for the local shard
  (``yamlformer.builder.optim``): AdamW ``exp_avg`` and ``exp_avg_sq`` (fp32, the local shard's shape)
  and a 4-byte ``step`` per parameter tensor, so a rank holds 16 bytes per local element plus 4
  per tensor, in bf16, fp16 and fp32 alike; Muon one fp32 momentum per element of a hidden matrix.
* **Transient** (an estimate, not exact): two units' gathered parameters (the one computing and
  the one prefetched) in the compute dtype, and the largest unit's unsharded gradients in the
  compute dtype plus their fp32 reduce-scatter input.

The layout value and its rank numbering are ``yamlformer.builder.mesh``'s, the refusals
per dimension ``yamlformer.builder.analysis.layout_rules``', the per-rank accounting
``yamlformer.builder.analysis.shards``';
this module gathers them, the one place the rest of the project imports them from.
"""

from __future__ import annotations

from yamlformer.builder.analysis.layout_rules import (
    check_layout,
    check_tensor_parallel,
    context_parallel_problems,
    expert_parallel_problems,
    experts_of,
    layout_problems,
    padded_for,
    pipeline_parallel_problems,
    tensor_parallel_problems,
    tensor_parallel_spec,
)
from yamlformer.builder.analysis.shards import FP32, RankStates, chunk_rows, rank_states, sharded_memory, unit_sizes
from yamlformer.builder.mesh import DATA_PARALLEL, DEGREES, STRATEGIES, Layout, LayoutError
from yamlformer.builder.tensors import EMBEDDING_PLAN, ParamTensor, layer_tensor_count, model_tensors

__all__ = [
    "DATA_PARALLEL",
    "DEGREES",
    "EMBEDDING_PLAN",
    "FP32",
    "STRATEGIES",
    "Layout",
    "LayoutError",
    "ParamTensor",
    "RankStates",
    "check_layout",
    "check_tensor_parallel",
    "chunk_rows",
    "context_parallel_problems",
    "expert_parallel_problems",
    "experts_of",
    "layer_tensor_count",
    "layout_problems",
    "model_tensors",
    "padded_for",
    "pipeline_parallel_problems",
    "rank_states",
    "sharded_memory",
    "tensor_parallel_problems",
    "tensor_parallel_spec",
    "unit_sizes",
]
