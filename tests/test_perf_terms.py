"""Each term of the performance model against hand-computed values: the blocks' memory-bound bytes
(yamlformer.blocks.configs.traffic), the GEMM, attention, float8, FSDP-copy and tensor-parallel
terms (yamlformer.builder.analysis.perf_terms), and how a prediction adds them up."""

from __future__ import annotations

import dataclasses
import math

import pytest
from recipe_helpers import TINY_SPEC

from yamlformer.blocks.configs.traffic import cross_entropy, rms_norm, rotary
from yamlformer.builder.analysis.calibration import (
    CLIP_BYTES,
    Calibration,
    optimizer_bytes_per_parameter,
    reference,
)
from yamlformer.builder.analysis.hardware import gpu
from yamlformer.builder.analysis.layout import Layout
from yamlformer.builder.analysis.perf import Model, Run, predict
from yamlformer.builder.analysis.perf_model import Linear
from yamlformer.builder.analysis.perf_terms import (
    attention_seconds,
    float8_cast_bytes,
    fsdp_copy_bytes,
    tensor_parallel_seconds,
)
from yamlformer.builder.analysis.shards import mean_optimizer_bytes
from yamlformer.builder.spec.loader import load_spec

IDEAL = dataclasses.replace(reference(), collective_efficiency=1.0, latency=0.0)
#: a one-layer Llama: d 64, 4 query heads of 16, 2 key/value heads, SwiGLU 128, vocab 100, untied
SMALL = {
    **TINY_SPEC,
    "name": "small",
    "d_model": 64,
    "vocab_size": 100,
    "max_seq_len": 256,
    "tie_embeddings": False,
    "decoder": {
        **TINY_SPEC["decoder"],
        "n_layers": 1,
        "attention": {"n_heads": 4, "n_kv_heads": 2},
        "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 128},
    },
}


def test_each_block_counts_its_memory_bound_bytes_per_token():
    # RMSNorm in bf16: forward cast 6, pow 8, mean 4, normalise 8, weight 8, cast back 6 = 40 an element;
    # backward the casts 6 + 6, the weight's product 8 and gradient 16, the normalisation's 8 and 16,
    # mean 4, pow 12, the two gradients added 12 = 88
    norm = rms_norm(64, 2)
    assert (norm.forward, norm.backward, norm.fused_forward, norm.fused_backward) == (40 * 64, 88 * 64, 4 * 64, 10 * 64)
    assert rms_norm(64, 4).forward == 28 * 64  # fp32: no casts
    assert (rotary(96, 2).forward, rotary(96, 2).fused_forward) == (24 * 96, 4 * 96)
    loss = cross_entropy(100, 2, compiled_loss=False)
    assert (loss.forward, loss.backward) == (22 * 100, 26 * 100) and loss.fused_forward == loss.forward
    assert cross_entropy(100, 2, compiled_loss=True).forward == 4 * 100
    spec = load_spec(SMALL)
    layer = spec.stacks()["decoder"].layers()[0]
    parts = layer.traffic(64, 2, spec.position)
    assert parts["attention"].forward == 2 * 2 * 64  # the 4 x 16 output copied back to tokens
    assert parts["position"].forward == 12 * 2 * (4 + 2) * 16  # queries and keys rotated
    assert (parts["ffn"].forward, parts["ffn"].backward) == (5 * 2 * 128, 9 * 2 * 128)  # SwiGLU
    assert parts["norms"].forward == 2 * 40 * 64 and parts["residual"].forward == 2 * 3 * 2 * 64
    head = spec.head.traffic(64, 100, 2)
    assert head.forward == 22 * 100


def test_attention_is_rated_piece_by_piece_as_the_ring_runs_it():
    row = gpu("h200")
    cal = reference()
    rates = lambda q, k, c: cal.attention_rates("flash", q, k, c, row)
    run = Run(seq_len=65536, global_batch=1)
    core = 1e15
    forward, total = attention_seconds(core, 65536, 1, True, run, cal, row)
    f, b = rates(65536, 65536, True)
    assert forward == pytest.approx(core / f) and total == pytest.approx(core / f + 2 * core / b)
    # ring over 2: a causal step over the rank's 32,768 (half the work), two half-block shapes for the rest
    forward, total = attention_seconds(core, 65536, 2, True, run, cal, row)
    first, one, other = rates(32768, 32768, True), rates(32768, 16384, False), rates(16384, 32768, False)
    want_forward = core * (0.5 / first[0] + 0.25 / one[0] + 0.25 / other[0])
    backward = 2 * core * (0.5 / first[1] + 0.25 / one[1] + 0.25 / other[1])
    assert forward == pytest.approx(want_forward) and total == pytest.approx(want_forward + backward)
    full = attention_seconds(core, 65536, 2, True, dataclasses.replace(run, recompute="full"), cal, row)[1]
    assert full == pytest.approx(2 * want_forward + backward)
    triton = attention_seconds(core, 4096, 1, True, dataclasses.replace(run, attention="triton"), cal, row)
    assert triton[0] == pytest.approx(core / 321.0e12)  # the Triton kernel's measured 4,096 row


def test_float8_casts_fsdp_copies_and_tensor_parallel_exposure():
    linear = Linear("ffn", "colwise", k=64, n=32)
    run = Run(seq_len=8, global_batch=1, float8=True, float8_all_gather=True)
    # 10 tokens, TP 2 (the input cast before its gather: half), the weight cast on a quarter (FSDP 4)
    forward, backward = float8_cast_bytes((linear,), 10, 2, 4, run)
    assert forward == 10 * 5 * 64 / 2 + 5 * 64 * 32 / 4
    assert backward == 10 * (5 * 32 + 2 * (64 + 32)) + 2 * 64 * 32 / 4
    assert float8_cast_bytes((linear,), 10, 2, 4, dataclasses.replace(run, float8=False)) == (0.0, 0.0)
    # 1000 parameters over 4 ranks, gathered twice in bf16: cast in (read 4, write 2, a quarter) and
    # copied out (read and write 2) per gather; the gradients cast in (read 2, write 4), added into the shard
    assert fsdp_copy_bytes(1000, 4, 2, 2, 2) == 2 * 1000 * (4 + 6 / 4) + 1000 * (6 + 8 / 4)
    # tensor parallelism over 2 at 100 GB/s: a gather and a scatter of 1 MB each move half of it (5 us)
    tokens, d = 256, 2048  # 1 MiB in bf16
    one = tokens * d * 2 / 2 / 100e9
    gemms = {"ffn": {"colwise": 3 * 2e-6, "rowwise": 3 * 8e-6}}  # a 2 us and an 8 us forward GEMM
    sync = Run(seq_len=256, global_batch=1)
    total, exposed = tensor_parallel_seconds(gemms, tokens, d, 2, 100e9, sync, IDEAL)
    assert total == exposed == pytest.approx(4 * one)
    total, exposed = tensor_parallel_seconds(
        gemms, tokens, d, 2, 100e9, dataclasses.replace(sync, async_tp=True), IDEAL
    )
    # forward: the gather waits 5 - 2 us, the scatter hides; backward: the scatter behind 2 x 2 us waits 1 us
    assert total == pytest.approx(4 * one) and exposed == pytest.approx((one - 2e-6) + (one - 4e-6))


def test_a_prediction_is_its_counted_terms():
    spec = load_spec(SMALL)
    row = gpu("h200")
    cal = reference()
    run = Run(seq_len=256, global_batch=8, micro_batch=8, attention="flash")
    p = predict(spec, Layout(devices=1), run, row, cal)
    model = Model(spec, 256)
    tokens, hbm = 8 * 256, cal.hbm(row)
    # GEMMs: q, k, v, out and the three SwiGLU linears at their rows' rates, and the head's projection
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]
    layer = sum(cal.linear_seconds("bf16", tokens, k, n, row) for k, n in shapes)
    assert p.breakdown["gemm"] == pytest.approx(layer + cal.linear_seconds("bf16", tokens, 64, 100, row))
    # memory-bound: each part's bytes per token, forward and backward once, over the measured bandwidth
    parts = model.traffic(1, True)[0]
    for part in ("norms", "ffn", "position", "residual", "attention"):
        t = parts[part]
        assert p.memory_bound[part] == pytest.approx(tokens * (t.forward + t.backward) / hbm)
    params = model.estimate.params.total
    assert optimizer_bytes_per_parameter() == 28  # AdamW: weight, gradient, two moments read; three written
    assert p.breakdown["optimizer"] == pytest.approx(params * (28 + CLIP_BYTES) / hbm)
    # Muon keeps one fp32 momentum on the hidden matrices (AdamW's two on the rest): its step moves less
    muon = predict(spec, Layout(devices=1), dataclasses.replace(run, optimizer="muon"), row, cal)
    state = mean_optimizer_bytes(spec, "muon")
    assert 4 < state < 8
    assert muon.breakdown["optimizer"] == pytest.approx(params * (12 + 2 * state + CLIP_BYTES) / hbm)
    assert p.breakdown["memory_bound"] == pytest.approx(sum(p.memory_bound.values()))
    assert p.step_s == pytest.approx(sum(p.breakdown.values()))
    compiled = predict(spec, Layout(devices=1), dataclasses.replace(run, compile=True), row, cal)
    assert (
        compiled.memory_bound["norms"] < p.memory_bound["norms"] / 5
        and compiled.breakdown["gemm"] == p.breakdown["gemm"]
    )
    assert math.isclose(p.tokens_per_s_per_gpu, 8 * 256 / p.step_s)
    assert isinstance(cal, Calibration)
