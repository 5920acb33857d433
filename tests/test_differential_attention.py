"""Differential attention (``blocks/differential.py``) beyond what the registry-wide tests check for
every attention block (counts, FLOPs, shapes, cached == recomputed decoding, the JSON Schema, the
tiny spec): the paper's algorithm written out as its code does, lambda_init from the layer's
place, the rules, and (slow, two CPU processes) tensor parallelism summing the gradients of the
tensors the heads share."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sharded_helpers import end_process_group

from yamlformer.blocks import registry
from yamlformer.blocks.attention import AttentionInputs
from yamlformer.blocks.build import Dims, build_block
from yamlformer.blocks.init import init_weights
from yamlformer.builder import build_model, load_spec
from yamlformer.builder.spec.loader import SpecError

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "specs" / "tiny" / "diff-transformer.yaml"
B, S, D = 2, 7, 32


def _block(seed: int = 0, layer_index: int = 0, **fields):
    config = registry.config_class("attention", "differential").model_validate({"type": "differential", **fields})
    torch.manual_seed(seed)
    module = build_block(
        config, Dims(d_model=D, vocab_size=50, max_seq_len=16), causal=True, backend="eager", layer_index=layer_index
    )
    return config, init_weights(module)


def _paper(module, x: torch.Tensor) -> torch.Tensor:
    """MultiheadDiffAttn.forward of the paper's code (microsoft/unilm, Diff-Transformer), without
    rotary positions: 2n half-heads of d, values of 2d, A1 - lambda A2, subln, (1 - lambda_init)."""
    bsz, tgt_len, _ = x.shape
    n, n_kv, d = module.n_heads, module.n_kv_heads, module.head_dim
    q = module.q_proj(x).view(bsz, tgt_len, 2 * n, d).transpose(1, 2)
    k = module.k_proj(x).view(bsz, tgt_len, 2 * n_kv, d).transpose(1, 2)
    v = module.v_proj(x).view(bsz, tgt_len, n_kv, 2 * d).transpose(1, 2)
    rep = n // n_kv
    k = k.view(bsz, n_kv, 2, tgt_len, d).repeat_interleave(rep, dim=1).reshape(bsz, 2 * n, tgt_len, d)
    v = v.repeat_interleave(rep, dim=1)
    weights = (q * d**-0.5) @ k.transpose(-1, -2)
    weights = weights + torch.triu(torch.full((tgt_len, tgt_len), float("-inf")), 1)
    weights = F.softmax(weights, dim=-1, dtype=torch.float32)
    lambda_1 = torch.exp(torch.sum(module.lambda_q1 * module.lambda_k1, dim=-1))
    lambda_2 = torch.exp(torch.sum(module.lambda_q2 * module.lambda_k2, dim=-1))
    lambda_full = lambda_1 - lambda_2 + module.lambda_init
    weights = weights.view(bsz, n, 2, tgt_len, tgt_len)
    attn = (weights[:, :, 0] - lambda_full * weights[:, :, 1]) @ v
    attn = F.rms_norm(attn, (2 * d,), module.subln.weight, eps=module.eps) * (1 - module.lambda_init)
    return module.out_proj(attn.transpose(1, 2).reshape(bsz, tgt_len, n * 2 * d))


@pytest.mark.parametrize(
    "fields", [{"n_heads": 2}, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 6}, {"n_heads": 2, "n_kv_heads": 1}]
)
def test_matches_the_papers_code(fields):
    _, module = _block(**fields)
    with torch.no_grad():  # lambda away from lambda_init, the norm weight away from 1
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(module, name).normal_(0, 0.5)
        module.subln.weight.uniform_(0.5, 1.5)
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1))
    ours = module(x, AttentionInputs(0, S))
    torch.testing.assert_close(ours, _paper(module, x), rtol=1e-5, atol=1e-6)


def test_lambda_init_follows_the_layers_place():
    """0.8 - 0.6 exp(-0.3 l), layers counted from 0 (the paper's code), unless the spec sets it."""
    model = build_model(load_spec(TINY))
    got = [layer.attention.lambda_init for layer in model.decoder.layers]
    assert got == pytest.approx([0.8 - 0.6 * math.exp(-0.3 * i) for i in range(2)])
    assert got[0] == pytest.approx(0.2)
    fixed = build_model(load_spec(TINY, overrides={"decoder.attention.lambda_init": 0.5}))
    assert [layer.attention.lambda_init for layer in fixed.decoder.layers] == [0.5, 0.5]
    _, module = _block(layer_index=5, n_heads=2)
    assert module.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-1.5))


def test_lambda_starts_near_lambda_init_and_learns():
    _, module = _block(n_heads=2)
    lam = module.lambda_full()
    assert abs(lam.item() - module.lambda_init) < 0.2  # exp(lq1.lk1) - exp(lq2.lk2), both near 1
    x = torch.randn(B, S, D)
    module(x, AttentionInputs(0, S)).pow(2).sum().backward()
    assert all(getattr(module, n).grad.abs().sum() > 0 for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"))


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_every_backend_computes_the_two_maps_alike(backend):
    """The two maps are two kernel calls on strided half-heads: SDPA and the Triton kernels (the
    CPU interpreter here) give eager's logits, with a window and grouped keys."""
    spec = load_spec(TINY, overrides={"decoder.attention.sliding_window": 5})
    torch.manual_seed(0)
    eager = build_model(spec, attention_backend="eager").eval()
    other = build_model(spec, attention_backend=backend).eval()
    other.load_state_dict(eager.state_dict())
    ids = torch.randint(0, spec.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(other(ids), eager(ids), rtol=1e-4, atol=1e-5)


def test_the_tiny_spec_trains_a_step():
    spec = load_spec(TINY)
    torch.manual_seed(0)
    model = build_model(spec)
    ids = torch.randint(0, spec.vocab_size, (2, 12))
    losses = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_rules_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {TINY}\ndecoder:\n  attention:\n    n_heads: 3\n")  # 64 / (2 * 3)
    with pytest.raises(SpecError) as err:
        load_spec(bad)
    [problem] = err.value.problems
    assert problem.path == "decoder.attention.n_heads" and "2 * n_heads" in problem.message
    grouped = tmp_path / "grouped.yaml"
    grouped.write_text(f"extends: {TINY}\ndecoder:\n  attention:\n    n_heads: 4\n    n_kv_heads: 3\n")
    with pytest.raises(SpecError, match="must be a multiple of n_kv_heads"):
        load_spec(grouped)


# -- slow: tensor parallelism on two CPU processes (gloo) -----------------------------------------


def _tp_worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from yamlformer.recipes.parallel.tensor import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    spec = load_spec(TINY, overrides={"decoder.attention.n_kv_heads": 2})
    torch.manual_seed(0)
    model = build_model(spec, attention_backend="eager")
    apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    ids = torch.randint(0, spec.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = grad.clone()
    torch.save(grads, Path(out) / f"{rank}.pt")
    end_process_group()


@pytest.mark.slow
def test_tensor_parallel_sums_the_shared_gradients(tmp_path):
    """Each rank computes one head; lambda and the norm weight get every head's gradient, as one
    process gives them, on both ranks."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    spec = load_spec(TINY, overrides={"decoder.attention.n_kv_heads": 2})
    torch.manual_seed(0)
    model = build_model(spec, attention_backend="eager")
    ids = torch.randint(0, spec.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    for rank in range(2):
        grads = torch.load(tmp_path / f"{rank}.pt")
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=f"rank {rank}: {name}")
