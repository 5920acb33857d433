"""Training and inference memory of a spec, in bytes, per device (torch-free).

The accounting (printed with every estimate, see :data:`CONVENTIONS`):

* **Weights, gradients, optimizer.** Weights and gradients in the compute dtype. With bf16 or
  fp16 (mixed precision) the optimizer steps an fp32 master copy of the weights, 4 bytes per
  parameter more. The optimizer's state is what it declares (``yamlformer.builder.optim``,
  :func:`~yamlformer.builder.optim.optimizer_state_bytes`): AdamW, the default, two fp32 states per
  parameter (exp_avg, exp_avg_sq), 8 bytes, and an fp32 step per tensor; so 16 bytes per
  parameter in all, in every dtype: fp32 is 4 + 4 + 8, bf16 is 2 + 4 + 2 + 8. Muon keeps one fp32
  momentum per element of a hidden matrix (12 bytes per parameter there), SGD one (or none).
* **Activations.** What autograd keeps between forward and backward, following Korthikanti et al.
  2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4) but summed
  per block from what each block declares (``saved_bytes`` in ``blocks/configs``) instead of
  their single ``sbh(34 + 5as/h)``: grouped-query k and v are n_kv_heads wide (n_heads wide
  after the eager path repeats them), head_dim may differ from d_model / n_heads, a GLU keeps
  four hidden-width tensors (gate, act(gate), up, their product) where an MLP keeps two, a
  mixture of experts keeps its router and top_k experts' tensors for every token, and a fused
  attention kernel keeps its output and an fp32 log-sum-exp per row instead of the (seq, seq)
  probabilities. Dropout keeps a one-byte mask per element. The LM head keeps its input, the
  logits and the loss's fp32 log-probabilities. Parameters are never counted twice.
* **Activation checkpointing** (every layer): each layer keeps only its input; during backward
  one layer at a time is recomputed, so the largest layer's activations are added once.
* **Strategies.** DDP replicates everything (its gradient buckets are not counted). FSDP (FSDP2,
  with tensor parallelism or not) is counted tensor by tensor in ``yamlformer.builder.analysis.layout``: what the
  rank holding the most keeps, exactly, plus the transient gathered units. Activations are per
  device for ``batch`` sequences on that device (one tensor-parallel rank's share under TP).
* **KV cache** for ``generate``: keys and values of every self-attention layer for the whole
  context (a layer with a sliding window w keeps only the last w positions), plus the
  cross-attention keys and values of the encoder output in an encoder-decoder, in the compute
  dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: bytes per element of each compute dtype: every estimate, the performance model and the shards count with these
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = BYTES["fp32"]

CONVENTIONS = (
    (
        "memory: weights and gradients in the compute dtype; bf16/fp16 adds fp32 master weights "
        "(mixed precision); the optimizer's declared state (AdamW: two fp32 states and a step per tensor, "
        "16 bytes per parameter in every dtype; Muon: one on hidden matrices)"
    ),
    (
        "activations: the tensors each block saves for backward (Korthikanti et al. 2022 adapted "
        "per block: GQA, head_dim, GLU, MoE top_k; a fused attention kernel saves no (seq, seq) "
        "tensor, eager saves fp32 probabilities); checkpointing keeps each layer's input and "
        "recomputes one layer at a time"
    ),
    (
        "DDP replicates everything; FSDP2 (and tensor parallelism) per rank, exactly, as "
        "yamlformer.builder.analysis.layout counts it: fp32 shards (torch.chunk on dim 0; rank 0 "
        "holds the most) that are the master weights, fp32 sharded gradients, the optimizer's declared state "
        "(AdamW: two states and a step per tensor), plus two gathered units and one unit's gradients in flight"
    ),
    (
        "KV cache: keys and values of every self-attention layer for the context (a sliding window "
        "w keeps the last w), plus cross-attention keys and values of the source, compute dtype"
    ),
    (
        "adapters (LoRA, DoRA): only they train; the frozen base keeps its weights alone (compute dtype, "
        "an NF4 weight at torchao's bytes: 4 bits a value, an int8 scale per 64), no gradients, master "
        "copy or AdamW state; their activations add what each adapter saves beyond its layer's input"
    ),
    (
        "a reference model (preference tuning without adapters): a frozen copy, its weights alone in the "
        "compute dtype, sharded over every rank under FSDP"
    ),
)


@dataclass
class MemoryEstimate:
    """Bytes per device for one training step and for decoding with a KV cache."""

    dtype: str
    batch: int
    devices: int
    strategy: str
    activation_checkpointing: bool
    weights: int
    master_weights: int
    gradients: int
    optimizer: int
    sharding_buffers: int
    activations: int
    activations_per_layer: int  # the largest layer's saved tensors, without checkpointing
    kv_cache: int  # batch sequences of seq_len context (target side), in the compute dtype
    inference_weights: int = 0  # the whole model (one tensor-parallel rank's share) in the compute dtype
    layout: dict[str, Any] | None = None  # FSDP/TP: the mesh and its largest and smallest ranks
    reference: int = 0  # a frozen copy of the model (preference tuning's reference), its weights alone

    @property
    def training_total(self) -> int:
        return (
            self.weights
            + self.master_weights
            + self.gradients
            + self.optimizer
            + self.sharding_buffers
            + self.activations
            + self.reference
        )

    @property
    def inference_total(self) -> int:
        """Weights (unsharded) and the KV cache."""
        return self.inference_weights + self.kv_cache

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["training_total"] = self.training_total
        out["inference_total"] = self.inference_total
        return out


def memory(
    spec,
    n_params: int,
    layers,
    *,
    batch: int,
    seq_len: int,
    src_len: int | None,
    dtype: str,
    devices: int,
    strategy: str,
    activation_checkpointing: bool,
    fused_attention: bool = True,
    frozen: int = 0,
    frozen_bytes: int = 0,
    head_saved: int = 0,
    optimizer: int = 0,
) -> MemoryEstimate:
    """Per-device training memory and the KV cache, from the per-layer estimates, every state
    whole on the device (DDP); ``yamlformer.builder.analysis.estimates`` shards them for FSDP through
    ``yamlformer.builder.analysis.layout``. Of the ``n_params`` parameters, ``frozen`` do not train:
    they keep their weights only, in ``frozen_bytes`` (an NF4 weight at its real bytes), no
    gradient, master copy or optimizer state; ``head_saved``: bytes the head's adapters keep.
    ``optimizer``: the bytes of the optimizer's state for the trainable parameters
    (``yamlformer.builder.analysis.shards.optimizer_bytes``)."""
    act = BYTES[dtype]
    trainable = n_params - frozen
    weights = trainable * act + frozen_bytes
    gradients = trainable * act
    master = trainable * FP32 if act != FP32 else 0
    activations = head_saved + activation_bytes(
        spec, layers, batch, seq_len, src_len, act, activation_checkpointing, fused_attention
    )
    return MemoryEstimate(
        dtype=dtype,
        batch=batch,
        devices=devices,
        strategy=strategy,
        activation_checkpointing=activation_checkpointing,
        weights=weights,
        master_weights=master,
        gradients=gradients,
        optimizer=optimizer,
        sharding_buffers=0,
        activations=activations,
        activations_per_layer=max((layer.saved_bytes for layer in layers), default=0),
        kv_cache=kv_cache_bytes(spec, batch, seq_len, dtype, src_len=src_len),
        inference_weights=weights,
    )


def activation_bytes(
    spec,
    layers,
    batch: int,
    seq_len: int,
    src_len: int | None,
    act: int,
    checkpointing: bool,
    fused_attention: bool = True,
) -> int:
    """Bytes saved for backward over one training step of ``batch`` sequences."""
    d, vocab = spec.d_model, spec.padded_vocab_size  # the tables and projection hold the padded rows
    stacks = spec.stacks()
    memory_of = spec.architecture_config.memory_of  # stack -> the stack its cross-attention reads
    lengths = {name: (src_len if name in memory_of.values() and src_len else seq_len) for name in stacks}
    total = 0
    for name, stack in stacks.items():
        tokens = batch * lengths[name]
        total += tokens * 8  # int64 token ids, kept by the embedding lookup
        if spec.embedding.norm is not None:
            total += spec.embedding.norm.saved_bytes(d, tokens, act)
        if spec.embedding.dropout > 0:
            total += tokens * d  # one-byte mask
        if stack.final_norm:
            total += stack.norm.saved_bytes(d, tokens, act)
        total += spec.position.saved_bytes_per_stack(lengths[name], stack.attention.query_heads(), fused_attention)
    for source in set(memory_of.values()):
        total += batch * lengths[source] * d * act  # encoder output: every cross-attention's k/v input
    last = list(stacks)[-1]
    total += spec.head.saved_bytes(
        d, vocab, batch * lengths[last], act, batch=batch, fused=fused_attention, position=spec.position
    )
    if not checkpointing:
        return total + sum(layer.saved_bytes for layer in layers)
    inputs = sum(batch * lengths[layer.stack] * d * act for layer in layers)
    return total + inputs + max((layer.saved_bytes for layer in layers), default=0)


def kv_cache_bytes(spec, batch: int, context: int, dtype: str = "bf16", src_len: int | None = None) -> int:
    """Bytes of the KV cache ``generate`` allocates for ``batch`` sequences of ``context`` tokens.

    Encoder-only models decode nothing: 0. ``src_len`` (encoder-decoder): the source length whose
    cross-attention keys and values are cached (default ``context``).
    """
    architecture = spec.architecture_config
    name = architecture.decoding_stack()
    if name is None:
        return 0
    cache, d = BYTES[dtype], spec.d_model
    cross = name in architecture.memory_of
    total = 0
    for indices, layer in spec.stacks()[name].layer_groups():  # identical layers counted once
        per_layer = layer.attention.kv_cache_bytes(d, batch, context, cache)
        if cross:
            per_layer += layer.cross_attention.kv_cache_bytes(d, batch, src_len or context, cache, cross=True)
        total += len(indices) * per_layer
    return total
