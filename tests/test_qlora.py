"""QLoRA on a CPU: a tiny model whose frozen base is torchao's NF4 trains its LoRA adapters, and the
estimate's weights, gradients and AdamW states are exactly the bytes the run holds (the NF4 base at
what torchao stores, the adapters alone with gradients and state); its activations are set against
the tensors autograd saves. The merged export folds the dequantized base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchao")

from yamlformer.builder import build_model, estimate, load_spec
from yamlformer.builder.hf import load_weights
from yamlformer.builder.hf.peft import merged

REPO = Path(__file__).resolve().parents[1]
SEQ, BATCH = 32, 4


def _bytes(t: torch.Tensor) -> int:
    """What a tensor stores: an NF4 tensor's inner tensors, any other's elements."""
    if hasattr(t, "__tensor_flatten__"):
        return sum(_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def _saved_bytes(model, ids, targets) -> int:
    """The bytes of the distinct storages autograd keeps for backward over one step."""
    storages: dict[int, int] = {}
    parameters = {p.data_ptr() for p in model.parameters() if not hasattr(p, "__tensor_flatten__")}

    def pack(t):
        if not hasattr(t, "__tensor_flatten__") and t.data_ptr() not in parameters:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten())
    loss.backward()
    return sum(storages.values())


def test_qlora_trains_on_a_cpu_and_holds_what_its_estimate_says():
    spec = load_spec(
        REPO / "specs" / "tiny" / "llama.yaml",
        overrides={"adapters": {"type": "lora", "rank": 8, "alpha": 16, "targets": "all-linear", "quantize": "nf4"}},
    )
    model = build_model(spec, init_seed=0, attention_backend="eager")
    quantized = [p for p in model.parameters() if hasattr(p, "__tensor_flatten__")]
    assert len(quantized) == 2 * 7  # every 2-D layer of both layers: q, k, v, out, gate, up, down
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (BATCH, SEQ + 1), generator=generator)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses  # the adapters learn the batch

    est = estimate(spec, seq_len=SEQ, batch=BATCH, dtype="fp32", fused_attention=False).memory
    assert est.weights == sum(_bytes(p) for p in model.parameters())
    assert est.gradients == sum(_bytes(p.grad) for p in trainable)
    states = optimizer.state.values()
    assert est.optimizer == sum(_bytes(s["exp_avg"]) + _bytes(s["exp_avg_sq"]) + _bytes(s["step"]) for s in states)
    assert est.master_weights == 0
    # activations: the estimate counts each block's inputs as full training keeps them; a frozen
    # base keeps fewer, so it is an upper bound here, and not a loose one
    saved = _saved_bytes(model, ids[:, :-1], ids[:, 1:])
    print(f"QLoRA on a CPU: weights, gradients, AdamW {est.weights:,}, {est.gradients:,}, {est.optimizer:,} B as held;")
    print(f"activations estimated {est.activations:,} B, saved by autograd {saved:,} B")
    assert saved <= est.activations <= 2 * saved, (saved, est.activations)

    # merged: the dequantized base with the adapters folded in computes what the adapted model does
    plain, state = merged(spec, model.state_dict())
    folded = load_weights(build_model(plain, attention_backend="eager"), state).eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(folded(ids[:, :-1]), model(ids[:, :-1]), rtol=1e-4, atol=1e-4)
