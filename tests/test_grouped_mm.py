"""Grouped expert matmuls (``yamlformer.blocks.experts.grouped_linear``): torch's ``F.grouped_mm`` where it runs
gives the per-expert loop's outputs and gradients, empty experts included; where it does not run (a
dtype or layout it refuses) the loop does; FlopCounterMode counts both alike."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from yamlformer.blocks.experts import grouped_linear, grouped_mm_runs

COUNTS = torch.tensor([3, 0, 5, 2])  # an expert with no rows among them


def _operands(d_in: int, d_out: int, dtype=torch.float32, bias: bool = True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(COUNTS.sum()), d_in, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(len(COUNTS), d_out, d_in, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(len(COUNTS), d_out, generator=g, dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


def _run(grouped: bool, x, w, b, grad=None):
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    out = grouped_linear(x, w, b, COUNTS, grouped=grouped)
    if grad is None:
        out.sum().backward()  # a broadcast gradient (strides 0), which grouped_mm's backward refuses raw
    else:
        out.backward(grad)
    return out.detach(), [None if t is None else t.grad.clone() for t in (x, w, b)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_mm_gives_the_loops_outputs_and_gradients(dtype, bias):
    x, w, b = _operands(16, 8, dtype, bias)
    assert grouped_mm_runs(x, w)  # this torch runs it on CPU: the comparison is not loop against loop
    grad = torch.randn(len(x), 8, generator=torch.Generator().manual_seed(1), dtype=dtype)
    for g in (None, grad):
        loop, loop_grads = _run(False, x, w, b, g)
        grouped, grouped_grads = _run(True, x, w, b, g)
        tol = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        torch.testing.assert_close(grouped, loop, **tol)
        for ours, theirs in zip(grouped_grads, loop_grads):
            if theirs is not None:
                torch.testing.assert_close(ours, theirs, **tol)
        assert not loop_grads[1][1].any() and not grouped_grads[1][1].any()  # the empty expert: zero


def test_where_grouped_mm_does_not_run_the_loop_does():
    x, w, b = _operands(6, 8)  # 6 fp32 = 24-byte rows: not 16-byte aligned
    assert not grouped_mm_runs(x, w)
    x64, w64, _ = _operands(16, 8, torch.float64)  # a dtype it does not take
    assert not grouped_mm_runs(x64, w64)
    assert not grouped_mm_runs(x[:, :4], w[..., :4])  # not contiguous
    out, _ = _run(True, x, w, b)
    want = torch.cat([xe @ w[e].T + b[e] for e, xe in enumerate(x.split(COUNTS.tolist()))])
    torch.testing.assert_close(out, want.detach())


def test_flop_counter_counts_grouped_mm_as_the_loop():
    x, w, b = _operands(16, 8, bias=False)
    counted = []
    for grouped in (False, True):
        with FlopCounterMode(display=False) as counter:
            _run(grouped, x, w, b)
        counted.append(counter.get_total_flops())
    assert counted[0] == counted[1] == 3 * 2 * 10 * 16 * 8  # forward, input and weight gradients


def test_grouped_experts_compute_the_same_through_either_path():
    from yamlformer.blocks import registry
    from yamlformer.blocks.configs.ffn import MoEConfig

    config = MoEConfig(
        n_experts=4,
        top_k=2,
        expert={"type": "glu", "hidden_dim": 32},
        router_bias=True,
        expert_bias=True,
        clamp={"alpha": 1.702, "limit": 7.0},
    )
    torch.manual_seed(0)
    moe = registry.module_class(config)(config, 16)
    x = torch.randn(2, 8, 16)
    results = []
    for grouped in (False, True):
        moe.zero_grad()
        moe.experts.grouped_mm = grouped
        out = moe(x)
        (out.square().mean() + moe.aux_loss).backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in moe.named_parameters()}))
    (loop, loop_grads), (grouped_out, grouped_grads) = results
    torch.testing.assert_close(grouped_out, loop)
    for name, grad in loop_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, msg=name)


@pytest.mark.parametrize("name", ["mixtral", "gpt-oss"])
def test_a_checkpoint_with_one_module_per_expert_loads_into_the_stacked_experts(name):
    """``moe``'s experts were separate modules before they were stacked: a state dict with
    ``experts.{e}.up_proj.weight`` names (biases too) loads, each tensor in its expert's row."""
    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.spec.loader import load_spec

    spec = load_spec(f"specs/tiny/{name}.yaml")
    torch.manual_seed(0)
    model = build_model(spec).eval()
    per_expert, unstacked = {}, 0
    for key, value in model.state_dict().items():
        head, _, tail = key.partition(".experts.")
        if tail and value.dim() >= 2 and tail.split(".")[0].endswith("_proj"):  # experts.up_proj.weight
            for e in range(value.shape[0]):
                per_expert[f"{head}.experts.{e}.{tail}"] = value[e].clone()
            unstacked += 1
        else:
            per_expert[key] = value.clone()
    assert unstacked >= 2
    fresh = build_model(spec).eval()
    fresh.load_state_dict(per_expert)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_under_compile_grouped_mm_takes_bfloat16_only(monkeypatch):
    """torch 2.13's meta kernel, which torch.compile traces with, takes bf16 only: while compiling,
    fp32 operands go through the loop and bf16 ones through grouped_mm (patched both ways)."""
    x32, w32, _ = _operands(16, 8)
    x16, w16, _ = _operands(16, 8, torch.bfloat16)
    for compiling in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda compiling=compiling: compiling)
        assert grouped_mm_runs(x32, w32) is not compiling
        assert grouped_mm_runs(x16, w16)
