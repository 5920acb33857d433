"""Attention kernels: every backend against an independent float64 reference.

On a machine without CUDA the Triton backend runs under the Triton interpreter (set up by
``yamlformer.kernels.triton_attention``); shapes are small so the whole file stays well under a minute.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_helpers import attend
from torch.utils.flop_counter import FlopCounterMode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["eager", "sdpa", "triton"]


def reference(q, k, v, causal=False, sliding_window=None, alibi_slopes=None, bias=None, softcap=None, scale=None):
    """Float64 attention written from the definition (no shared code with the kernels)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    kv_head = torch.arange(H, device=q.device) // (H // k.shape[1])
    k, v = k[:, kv_head], v[:, kv_head]  # (B, H, Sk, D) by gathering, not repeat_interleave
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    pos_q = torch.arange(Sq, device=q.device)[:, None] + (Sk - Sq)
    pos_k = torch.arange(Sk, device=q.device)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes.double()[:, None, None] * (pos_q - pos_k)
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        keep &= pos_k <= pos_q
    if sliding_window is not None:
        keep &= pos_q - pos_k < sliding_window
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total == 0, torch.ones_like(total), total)
    return torch.einsum("bhij,bhjd->bhid", p, v)


def make(B, H, Hkv, Sq, Sk, D, dtype=torch.float32, seed=0, Dv=None):
    """q, k, v and an output gradient; ``Dv``: the values' head dim (default ``D``)."""
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = torch.randn(B, H, Sq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, Sk, Dv, generator=g, dtype=dtype)
    dout = torch.randn(B, H, Sq, Dv, generator=g, dtype=dtype)
    return [t.to(DEVICE) for t in (q, k, v, dout)]


def run_with_grads(fn, q, k, v, dout, bias=None, **kw):
    """Output and grads of q, k, v (and bias when given) for ``fn(q, k, v, bias=..., **kw)``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    out = fn(*leaves, bias=b, **kw)
    out.backward(dout.to(out.dtype))
    grads = [t.grad for t in leaves] + ([b.grad] if b is not None else [])
    return out.detach(), grads


def assert_close(actual, expected, atol, rtol, what):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def check_backend(
    backend,
    B,
    H,
    Hkv,
    Sq,
    Sk,
    D,
    dtype=torch.float32,
    bias_shape=None,
    bias_fn=None,
    tol=(2e-4, 2e-4),
    grad_tol=None,
    Dv=None,
    **kw,
):
    q, k, v, dout = make(B, H, Hkv, Sq, Sk, D, dtype, Dv=Dv)
    bias = None
    if bias_shape is not None:
        g = torch.Generator().manual_seed(1)
        bias = torch.randn(*bias_shape, generator=g).to(DEVICE, dtype)
    if bias_fn is not None:
        bias = bias_fn().to(DEVICE, dtype)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(DEVICE)
    out, grads = run_with_grads(lambda *a, **k2: attend(*a, backend=backend, **k2), q, k, v, dout, bias=bias, **kw)
    ref, ref_grads = run_with_grads(reference, q, k, v, dout.double(), bias=bias, **kw)
    assert out.dtype == dtype
    assert_close(out, ref, *tol, f"{backend} out")
    for name, g_, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(g_, r, *(grad_tol or tol), f"{backend} {name}")


# name: (B, H, Hkv, Sq, Sk, D, kwargs)
CASES = {
    "mha-causal-17-d16": (1, 2, 2, 17, 17, 16, dict(causal=True)),
    "gqa-causal-77-d40": (2, 4, 2, 77, 77, 40, dict(causal=True)),
    "mqa-full-100-d64": (1, 4, 1, 100, 100, 64, {}),
    "mha-causal-len1-d128": (2, 2, 2, 1, 1, 128, dict(causal=True)),
    "gqa-decode-like-5x100": (1, 4, 2, 5, 100, 40, dict(causal=True)),
    "mha-sq-gt-sk-77x17": (1, 2, 2, 77, 17, 16, dict(causal=True)),
    "mha-noncausal-sq-lt-sk-17x100": (1, 2, 2, 17, 100, 16, {}),
    "gqa-window-100": (1, 4, 2, 100, 100, 64, dict(causal=True, sliding_window=20)),
    "mha-window-17x77": (1, 2, 2, 17, 77, 16, dict(causal=True, sliding_window=7)),
    "mha-alibi-causal-77": (
        1,
        4,
        4,
        77,
        77,
        16,
        dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    ),
    "mqa-alibi-full-17x40": (1, 4, 1, 17, 40, 16, dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))),
    "mha-bias-17x100": (2, 2, 2, 17, 100, 40, dict(bias_shape=(1, 2, 17, 100))),
    "gqa-bias-bcast-causal-77": (2, 4, 2, 77, 77, 16, dict(causal=True, bias_shape=(4, 1, 77))),
    "gqa-softcap-causal-77": (1, 4, 2, 77, 77, 40, dict(causal=True, softcap=2.0)),
    "mha-d128-causal-100": (1, 2, 2, 100, 100, 128, dict(causal=True)),
    "gqa-everything-17x100": (
        1,
        4,
        2,
        17,
        100,
        40,
        dict(
            causal=True,
            sliding_window=30,
            softcap=3.0,
            bias_shape=(1, 4, 17, 100),
            alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.05]),
        ),
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_float64_reference(backend, case):
    B, H, Hkv, Sq, Sk, D, kw = CASES[case]
    check_backend(backend, B, H, Hkv, Sq, Sk, D, **dict(kw))


# values narrower or wider than queries and keys: (B, H, Hkv, Sq, Sk, D, Dv, kwargs)
VALUE_DIM_CASES = {
    "mla-train-causal-33-d24-v16": (1, 2, 2, 33, 33, 24, 16, dict(causal=True)),
    "mla-absorbed-decode-1x40-d40-v32": (2, 4, 1, 1, 40, 40, 32, dict(causal=True)),
    "mla-absorbed-chunk-5x50-d24-v16": (1, 4, 1, 5, 50, 24, 16, dict(causal=True, bias_shape=(1, 1, 5, 50))),
    "wider-values-17x40-d16-v40": (
        1,
        4,
        2,
        17,
        40,
        16,
        40,
        dict(causal=True, softcap=3.0, sliding_window=9, alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.05])),
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(VALUE_DIM_CASES), ids=list(VALUE_DIM_CASES))
def test_value_head_dim_may_differ(backend, case):
    """DeepSeek's latent attention: 192-wide scores, 128-wide values; absorbed decoding is MQA
    over the latent with values narrower than the keys (the split-K decode path on Triton)."""
    B, H, Hkv, Sq, Sk, D, Dv, kw = VALUE_DIM_CASES[case]
    check_backend(backend, B, H, Hkv, Sq, Sk, D, Dv=Dv, **dict(kw))


def padding_mask():
    """(B, 1, 1, Sk) additive padding mask: batch 0 masks every key, batch 1 the last 20."""
    m = torch.zeros(2, 1, 1, 50)
    m[0] = float("-inf")
    m[1, ..., 30:] = float("-inf")
    return m


def query_padding_mask():
    """(B, 1, Sq, 1): some query rows see no key at all."""
    m = torch.zeros(2, 1, 50, 1)
    m[1, :, 10:25] = float("-inf")
    return m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_fn", [padding_mask, query_padding_mask])
def test_fully_masked_rows_give_zero(backend, mask_fn):
    check_backend(backend, 2, 2, 1, 50, 50, 16, bias_fn=mask_fn, causal=True)
    q, k, v, _ = make(2, 2, 1, 50, 50, 16)
    out = attend(q, k, v, bias=mask_fn().to(DEVICE), causal=True, backend=backend)
    dead = torch.isneginf(mask_fn().to(DEVICE)).all(-1, keepdim=True).expand_as(out)
    assert (out[dead] == 0).all()


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(backend, dtype):
    check_backend(
        backend,
        1,
        4,
        2,
        77,
        77,
        40,
        dtype=dtype,
        causal=True,
        softcap=5.0,
        alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
        tol=(3e-2, 3e-2),
        grad_tol=(6e-2, 6e-2),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, S, D = 2, 4, 2, 33, 40
    # (batch, seq, heads, head_dim) storage viewed as (batch, heads, seq, head_dim)
    q = torch.randn(B, S, H, D, generator=g).to(DEVICE).transpose(1, 2)
    kv = torch.randn(B, S, 2, Hkv, D, generator=g).to(DEVICE)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    dout = torch.randn(B, S, H, D, generator=g).to(DEVICE).transpose(1, 2)
    bias = torch.randn(S, S, generator=g).to(DEVICE).t()  # transposed, broadcast over B, H
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out, grads = run_with_grads(
        lambda *a, **kw: attend(*a, backend=backend, **kw), q, k, v, dout, bias=bias, causal=True
    )
    ref, ref_grads = run_with_grads(reference, q, k, v, dout.double(), bias=bias, causal=True)
    assert_close(out, ref, 2e-4, 2e-4, "out")
    for g_, r in zip(grads, ref_grads):
        assert_close(g_, r, 2e-4, 2e-4, "grad")


def test_out_of_bounds_canaries():
    """Inputs are slices of NaN-filled buffers: any read outside the slice poisons the result."""
    B, H, Hkv, Sq, Sk, D = 1, 4, 2, 37, 45, 24

    def guarded(*shape):
        buf = torch.full((shape[0], shape[1] + 1, shape[2] + 9, shape[3] + 8), float("nan"), device=DEVICE)
        view = buf[:, 1:, 3 : 3 + shape[2], 5 : 5 + shape[3]]
        view.copy_(torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))))
        return buf, view

    (qb, q), (kb, k), (vb, v), (gb, dout) = (
        guarded(B, H, Sq, D),
        guarded(B, Hkv, Sk, D),
        guarded(B, Hkv, Sk, D),
        guarded(B, H, Sq, D),
    )
    nan_before = [torch.isnan(b).sum().item() for b in (qb, kb, vb, gb)]
    bias_buf = torch.full((Sq + 4, Sk + 4), float("nan"), device=DEVICE)
    bias = bias_buf[2 : 2 + Sq, 1 : 1 + Sk]
    bias.zero_()
    out, grads = run_with_grads(
        lambda *a, **kw: attend(*a, backend="triton", **kw), q, k, v, dout, bias=bias, causal=True, sliding_window=16
    )
    ref, ref_grads = run_with_grads(reference, q, k, v, dout.double(), bias=bias, causal=True, sliding_window=16)
    assert_close(out, ref, 2e-4, 2e-4, "out")
    for g_, r in zip(grads, ref_grads):
        assert_close(g_, r, 2e-4, 2e-4, "grad")
    assert [torch.isnan(b).sum().item() for b in (qb, kb, vb, gb)] == nan_before


@pytest.mark.parametrize(
    "Sq,Sk,Hkv,kw",
    [
        (1, 100, 1, dict(causal=True)),
        (1, 100, 2, dict(causal=True, sliding_window=10)),  # most splits see nothing
        (
            3,
            77,
            4,
            dict(
                causal=True,
                alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
                softcap=4.0,
                bias_shape=(2, 4, 3, 77),
            ),
        ),
        (4, 2, 2, dict(causal=True)),  # more queries than keys: some rows see nothing
    ],
)
def test_decode_path(monkeypatch, Sq, Sk, Hkv, kw):
    from yamlformer.kernels import flash_launch

    calls = []  # (splits, split length) of each decode launch
    split = flash_launch.decode_split
    monkeypatch.setattr(flash_launch, "decode_split", lambda *a: calls.append(split(*a)) or calls[-1])
    check_backend("triton", 2, 4, Hkv, Sq, Sk, 40, **dict(kw))
    assert calls, "the split-K decode kernel was not used"
    if Sk >= 100 and DEVICE == "cpu":
        assert calls[0][0] > 1, "expected the cache split across several programs"


def _count_flops(fn, backward):
    with FlopCounterMode(display=False) as counter:
        out = fn()
        if backward:
            out.sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("backward", [False, True])
def test_flop_counter_matches_eager(backward):
    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 33, 50, 40
    q, k, v, _ = make(B, H, Hkv, Sq, Sk, D)
    counts = {}
    for backend in ("eager", "triton"):
        leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
        counts[backend] = _count_flops(lambda: attend(*leaves, causal=True, backend=backend), backward)
    forward = 4 * B * H * Sq * Sk * D  # two matmuls of 2 * B * H * Sq * Sk * D
    assert counts["eager"] == forward * (3 if backward else 1)
    assert counts["triton"] == counts["eager"]


def test_meta_tensors_give_shapes():
    from yamlformer.kernels import triton_attention  # noqa: F401  registers the ops

    q = torch.empty(2, 8, 5, 40, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 300, 40, device="meta", dtype=torch.bfloat16)
    bias = torch.empty(1, 8, 5, 300, device="meta", dtype=torch.bfloat16)
    out, lse = torch.ops.yamlformer.flash_attention(q, k, k, bias, None, True, 64, 30.0, 0.1)
    assert out.shape == (2, 8, 5, 40) and out.dtype == torch.bfloat16 and out.device == q.device
    assert lse.shape == (2, 8, 5) and lse.dtype == torch.float32
    dq, dk, dv, dbias, dsinks = torch.ops.yamlformer.flash_attention_backward(
        out, q, k, k, out, lse, bias, None, True, 64, 30.0, 0.1, True
    )
    assert (dq.shape, dk.shape, dv.shape, dbias.shape) == (q.shape, k.shape, k.shape, bias.shape)
    assert dsinks.numel() == 0  # no sinks: an empty gradient
    sinks = torch.empty(8, device="meta")
    out, lse = torch.ops.yamlformer.flash_attention(q, k, k, None, None, True, None, None, 0.1, None, sinks, 16)
    grads = torch.ops.yamlformer.flash_attention_backward(
        out, q, k, k, out, lse, None, None, True, None, None, 0.1, False, None, sinks, 16
    )
    assert grads[4].shape == (8,) and grads[4].dtype == torch.float32
    v = torch.empty(2, 2, 300, 24, device="meta", dtype=torch.bfloat16)  # narrower values
    out, lse = torch.ops.yamlformer.flash_attention(q, k, v, None, None, True, None, None, 0.1)
    assert out.shape == (2, 8, 5, 24)


def test_opcheck():
    from yamlformer.kernels import triton_attention

    q, k, v, _ = make(1, 2, 1, 9, 20, 16)
    bias = torch.randn(1, 2, 9, 20, device=DEVICE, requires_grad=True)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), bias, None, True, None, None, 0.25)
    torch.library.opcheck(
        triton_attention.flash_attention,
        args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_dropout(backend):
    q, k, v, _ = make(1, 2, 2, 17, 17, 16)
    torch.manual_seed(0)
    out = attend(q, k, v, causal=True, dropout_p=0.5, backend=backend)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, attend(q, k, v, causal=True, backend=backend))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(shape=(1, 2, 4, 300), backend="triton"), "head_dim <= 256"),
        (dict(shape=(1, 3, 4, 16), kv_heads=2), "multiple of n_kv_heads"),
        (dict(shape=(1, 2, 4, 16), backend="triton", dropout_p=0.1), "dropout"),
        (dict(shape=(1, 2, 4, 16), bias=torch.zeros(3, 4)), "does not broadcast"),
        (dict(shape=(1, 2, 4, 16), alibi_slopes=torch.zeros(3)), "alibi_slopes"),
        (dict(shape=(1, 2, 4, 16), sliding_window=0), "sliding_window"),
        (dict(shape=(1, 2, 4, 16), backend="flash"), "backend must be one of"),
        (dict(shape=(1, 2, 4, 16), v_len=5), "agree on batch, heads and length"),
    ],
)
def test_clear_errors(kwargs, message):
    kwargs = dict(kwargs)
    shape = kwargs.pop("shape")
    kv_heads = kwargs.pop("kv_heads", shape[1])
    v_len = kwargs.pop("v_len", shape[2])
    q = torch.zeros(shape)
    k = torch.zeros(shape[0], kv_heads, *shape[2:])
    v = torch.zeros(shape[0], kv_heads, v_len, shape[3])
    with pytest.raises(ValueError, match=message):
        attend(q, k, v, **kwargs)


def test_import_is_lazy_and_triton_runs_on_cpu():
    """Importing kernels does not import triton, nor touch the environment; a fresh process with
    no TRITON_INTERPRET can still run backend="triton" on CPU tensors (the interpreter is set up
    while Triton decorates and runs our kernels, and the environment is as it was after)."""
    code = (
        "import os, sys, torch, yamlformer.kernels\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
        "assert 'TRITON_INTERPRET' not in os.environ, 'TRITON_INTERPRET set on import'\n"
        "if not torch.cuda.is_available():\n"
        "    q = torch.randn(1, 2, 8, 16)\n"
        "    causal = yamlformer.kernels.Mask(causal=True)\n"
        "    out = yamlformer.kernels.attention(q, q, q, causal, backend='triton')\n"
        "    ref = yamlformer.kernels.attention(q, q, q, causal, backend='eager')\n"
        "    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()\n"
        "    assert 'TRITON_INTERPRET' not in os.environ, 'TRITON_INTERPRET left set'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=Path(__file__).parents[1])


def test_the_mask_is_one_frozen_value_and_the_op_takes_it_flat():
    """What a call masks travels as one ``Mask``; only the custom op's schema takes it flat, and
    the op rebuilds the same mask from it (``op_args`` and back)."""
    import dataclasses

    from yamlformer.kernels import Mask, attention, triton_attention

    q_index, k_index = torch.arange(4), torch.arange(8)
    mask = Mask(
        causal=True,
        sliding_window=5,
        chunk_size=4,
        alibi_slopes=torch.ones(2),
        bias=torch.zeros(4, 8),
        softcap=30,
        token_index=(q_index, k_index),
        sinks=torch.zeros(2),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        mask.causal = False
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=r"mask must be a yamlformer.kernels.Mask \(Mask\(causal=True"):
        attention(q, q, q, True)  # a bare causal flag where the mask goes
    assert mask.replace(causal=False).causal is False and mask.causal is True
    assert mask.present() == {name: name != "documents" for name in Mask.OPTIONS}
    bias, alibi, causal, window, softcap, scale, starts, sinks, chunk, qi, ki = triton_attention.op_args(mask, 0.5)
    assert (causal, window, softcap, scale, starts, chunk) == (True, 5, 30.0, 0.5, None, 4)
    back = triton_attention._mask(bias, alibi, causal, window, softcap, sinks, chunk, qi, ki)
    for field in dataclasses.fields(Mask):
        ours, theirs = getattr(mask, field.name), getattr(back, field.name)
        assert ours is theirs or ours == theirs, field.name  # the same tensors, the numbers as the op takes them
