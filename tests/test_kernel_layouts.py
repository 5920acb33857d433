"""The Triton attention op under ``torch.compile``: its fake implementation returns the shapes and
strides the kernels return, for every input layout the kernels take, and Inductor compiles a
model through the op (forward and backward) to eager's numbers. Runs under the interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from yamlformer.kernels import triton_attention as ta

ROOT = Path(__file__).resolve().parents[1]


def _layout(name: str, B=2, H=4, Hkv=2, S=24, D=16, Dv=16):
    """``(q, k, v)`` laid out as a model hands them to the kernel."""
    g = torch.Generator().manual_seed(0)
    if name == "contiguous":  # (B, H, S, D)
        return tuple(torch.randn(B, h, S, d, generator=g) for h, d in ((H, D), (Hkv, D), (Hkv, Dv)))
    if name == "transposed":  # projections viewed (B, S, H, D), then transposed: heads inner
        return tuple(torch.randn(B, S, h, d, generator=g).transpose(1, 2) for h, d in ((H, D), (Hkv, D), (Hkv, Dv)))
    if name == "fused-qkv":  # one (B, S, 3, H, D) projection sliced into q, k and v
        qkv = torch.randn(B, S, 3, H, D, generator=g)
        return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
    if name == "wider-keys":  # MLA: 24-wide query/key heads, 16-wide values
        return _layout("transposed", D=24, Dv=16)
    raise ValueError(name)


def _strides(tensors):
    return [(tuple(t.shape), t.stride(), t.dtype) for t in tensors]


@pytest.mark.parametrize("name", ["contiguous", "transposed", "fused-qkv", "wider-keys"])
@pytest.mark.parametrize("extras", ["plain", "bias-and-sinks"])
def test_the_fake_implementation_returns_the_kernels_strides(name, extras):
    q, k, v = _layout(name)
    H, S = q.shape[1], q.shape[2]
    bias = torch.randn(1, H, S, S).transpose(2, 3) if extras != "plain" else None  # a non-contiguous bias
    sinks = torch.randn(H) if extras != "plain" else None
    args = (q, k, v, bias, None, True, None, None, q.shape[-1] ** -0.5, None, sinks, None)
    out, lse = torch.ops.yamlformer.flash_attention(*args)
    grad_out = torch.randn(out.shape).transpose(1, 2).contiguous().transpose(1, 2)  # as autograd hands it
    back_args = (grad_out, q, k, v, out, lse, bias, None, True, None, None, args[8], bias is not None, None, sinks)
    grads = torch.ops.yamlformer.flash_attention_backward(*back_args, None)
    with FakeTensorMode() as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
        fake_out = torch.ops.yamlformer.flash_attention(*map(fake, args))
        fake_grads = torch.ops.yamlformer.flash_attention_backward(*map(fake, back_args), None)
    assert _strides(fake_out) == _strides((out, lse))
    assert _strides(fake_grads) == _strides(grads)


def test_inductor_compiles_a_model_through_the_triton_op(monkeypatch, tmp_path):
    """What crashed ``compile: true`` on a GPU at step 1 (Inductor's stride assertion on the op's
    backward): the Triton backend forced on the CPU, compiled by Inductor, forward and backward."""
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)  # no graph compiled before the fix
    from yamlformer.builder import build_model

    torch.manual_seed(0)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "extends": str(ROOT / "specs" / "tiny" / "llama.yaml"),
                "d_model": 32,
                "decoder": {"n_layers": 1, "attention": {"n_heads": 4, "n_kv_heads": 2}, "ffn": {"hidden_dim": 64}},
            }
        )
    )
    model = build_model(spec, attention_backend="triton")
    ids = torch.randint(0, 256, (2, 20))

    def loss():
        return model(ids).float().pow(2).mean()

    expected = loss()
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    got = torch.compile(loss)()
    got.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-6, msg=n)
    assert ta.INTERPRET  # the Triton kernels ran, interpreted
