"""Attention sinks and chunked attention on every backend, against a float64 reference written
here from the definitions: the sink as one more softmax column dropped afterwards, the chunks as
an explicit ``pos_q // C == pos_k // C`` mask. Forward and the gradients of q, k, v and the sinks,
in the usual layout (queries the last ``seq_q`` keys: cached decoding), with explicit token
indices (a static cache's slots) and with packed documents.

Without CUDA the Triton backend runs under the Triton interpreter: shapes stay small (the query
tiles are 32 rows there, so lengths of 40..70 still cross tiles and chunk boundaries).
"""

import math
import os

import pytest
import torch
from attention_helpers import attend
from torch.utils.flop_counter import FlopCounterMode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["eager", "sdpa", "triton"]


def reference(
    q,
    k,
    v,
    *,
    causal=False,
    sliding_window=None,
    chunk_size=None,
    sinks=None,
    token_index=None,
    docs=None,
    softcap=None,
    bias=None,
):
    """Float64 attention from the definitions (no code shared with the kernels)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    kv_head = torch.arange(H, device=q.device) // (H // k.shape[1])
    k, v = k[:, kv_head], v[:, kv_head]  # (B, H, Sk, D)
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    if token_index is None:
        pos_q, pos_k = torch.arange(Sk - Sq, Sk, device=q.device), torch.arange(Sk, device=q.device)
    else:
        pos_q, pos_k = token_index
    keep = (pos_k >= 0)[None, :].expand(Sq, Sk).clone()
    for i in range(Sq):
        for j in range(Sk):
            d = int(pos_q[i] - pos_k[j])
            if causal and d < 0 or sliding_window is not None and d >= sliding_window:
                keep[i, j] = False
            if chunk_size is not None and int(pos_q[i]) // chunk_size != int(pos_k[j]) // chunk_size:
                keep[i, j] = False
    keep = keep.expand(B, H, Sq, Sk)
    if docs is not None:  # same document id (ids are runs along the row)
        keep = keep & (docs[:, -Sq:, None] == docs[:, None, :])[:, None]
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        column = sinks.double()[None, :, None, None].expand(B, H, Sq, 1)
        p = torch.softmax(torch.cat((s, column), dim=-1), dim=-1)[..., :Sk]
    return torch.einsum("bhij,bhjd->bhid", p, v)


def make(B, H, Hkv, Sq, Sk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g)
    k = torch.randn(B, Hkv, Sk, D, generator=g)
    v = torch.randn(B, Hkv, Sk, D, generator=g)
    dout = torch.randn(B, H, Sq, D, generator=g)
    sinks = torch.randn(H, generator=g) * 2.0
    return [t.to(DEVICE) for t in (q, k, v, dout, sinks)]


def grads_of(fn, q, k, v, sinks, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    s = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    out = fn(*leaves, s)
    out.backward(dout.to(out.dtype))
    return out.detach(), [t.grad for t in leaves] + ([s.grad] if s is not None else [])


def check(backend, shape, with_sinks=True, tol=2e-4, docs=None, token_index=None, seed=0, with_bias=False, **kw):
    q, k, v, dout, sinks = make(*shape, seed=seed)
    if with_bias:  # an additive (1, H, Sq, Sk) bias, as a relative-position block gives
        B, H, _, Sq, Sk, _ = shape
        kw["bias"] = torch.randn(1, H, Sq, Sk, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    sinks = sinks if with_sinks else None
    extra = {} if docs is None else dict(document_ids=docs)
    if token_index is not None:
        extra["token_index"] = token_index
    out, grads = grads_of(lambda *a: attend(*a[:3], sinks=a[3], backend=backend, **extra, **kw), q, k, v, sinks, dout)
    ref, ref_grads = grads_of(
        lambda *a: reference(*a[:3], sinks=a[3], token_index=token_index, docs=docs, **kw),
        q,
        k,
        v,
        sinks,
        dout.double(),
    )
    assert out.dtype == q.dtype
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), [out, *grads], [ref, *ref_grads]):
        assert got.shape == want.shape, name
        assert torch.isfinite(got).all(), f"{backend} {name}: non-finite"
        torch.testing.assert_close(
            got.double(), want.double(), atol=tol, rtol=tol, msg=lambda m: f"{backend} {name}: {m}"
        )
    return out


# name: ((B, H, Hkv, Sq, Sk, D), kwargs)
CASES = {
    "sinks-gqa-causal-40": ((2, 4, 2, 40, 40, 16), dict(causal=True)),
    "sinks-full-17x45": ((1, 2, 1, 17, 45, 16), {}),
    "sinks-window-decode-3x70": ((1, 4, 2, 3, 70, 16), dict(causal=True, sliding_window=9)),
    "chunk-causal-70-c7": ((1, 2, 2, 70, 70, 16), dict(causal=True, chunk_size=7, with_sinks=False)),
    "chunk-full-40-c16": ((1, 2, 1, 40, 40, 16), dict(chunk_size=16, with_sinks=False)),
    "chunk-sinks-causal-70-c32": ((1, 4, 2, 70, 70, 16), dict(causal=True, chunk_size=32)),
    "chunk-sinks-window-45x70-c20": ((1, 2, 2, 45, 70, 16), dict(causal=True, chunk_size=20, sliding_window=13)),
    "chunk-sinks-decode-2x70-c16": ((2, 4, 1, 2, 70, 16), dict(causal=True, chunk_size=16)),
    "everything-40x50-c12": (
        (1, 4, 2, 40, 50, 16),
        dict(causal=True, chunk_size=12, sliding_window=9, softcap=3.0, with_bias=True),
    ),
    "everything-decode-3x50-c12": (
        (1, 4, 2, 3, 50, 16),
        dict(causal=True, chunk_size=12, sliding_window=9, softcap=3.0, with_bias=True),
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(backend, case):
    shape, kw = CASES[case]
    check(backend, shape, **dict(kw))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no-sinks"])
def test_documents(backend, with_sinks):
    """Packed documents with chunks: a query sees its own document and chunk only."""
    docs = torch.tensor([[0] * 12 + [1] * 30 + [2] * 8, [0] * 50], device=DEVICE)
    check(backend, (2, 2, 1, 50, 50, 16), with_sinks=with_sinks, causal=True, chunk_size=8, docs=docs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_index_static_cache(backend):
    """A static cache's slots: keys out of token order, two empty slots; chunks and sinks follow
    the token indices, not the slots."""
    key_index = torch.tensor([8, 9, 10, 11, 12, 13, -1, -1, 0, 1, 2, 3, 4, 5, 6, 7], device=DEVICE)
    query_index = torch.tensor([11, 12, 13], device=DEVICE)
    check(backend, (1, 4, 2, 3, 16, 16), token_index=(query_index, key_index), causal=True, chunk_size=6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_equals_recomputation(backend):
    """The last rows of a full chunked, sinked forward equal the same queries against the cache."""
    q, k, v, _, sinks = make(1, 4, 2, 40, 40, 16, seed=4)
    kw = dict(causal=True, chunk_size=12, sinks=sinks, backend=backend)
    full = attend(q, k, v, **kw)
    for t in (1, 3):
        cached = attend(q[:, :, -t:], k, v, **kw)
        torch.testing.assert_close(cached, full[:, :, -t:], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_with_a_sink_give_zero(backend):
    """A row with no visible key puts all its weight on the sink: output 0, not NaN, and its
    gradients are finite (the sink's gets nothing from such a row)."""
    B, H, S, D = 1, 2, 20, 16
    q, k, v, dout, sinks = make(B, H, H, S, S, D, seed=2)
    bias = torch.zeros(B, 1, S, S, device=DEVICE)
    bias[..., 5:9, :] = float("-inf")  # rows 5..8 see nothing
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    out = attend(*leaves[:3], bias=bias, sinks=leaves[3], causal=True, chunk_size=4, backend=backend)
    assert (out[:, :, 5:9] == 0).all() and torch.isfinite(out).all()
    out.backward(dout)
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert (leaves[0].grad[:, :, 5:9] == 0).all()


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_bfloat16(backend):
    q, k, v, dout, sinks = make(1, 4, 2, 33, 33, 16, seed=5)
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    out = attend(*bf, sinks=sinks, causal=True, chunk_size=8, backend=backend)
    ref = reference(*bf, sinks=sinks, causal=True, chunk_size=8)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_sinks_lower_each_rows_weight():
    """With values all ones the output is each row's total weight: 1 / (1 + exp(sink - lse))."""
    q, k, _, _, sinks = make(1, 2, 2, 6, 6, 8, seed=6)
    v = torch.ones(1, 2, 6, 8, device=DEVICE)
    out = attend(q, k, v, sinks=sinks, causal=True, backend="eager")
    lse = (
        (torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(8))
        .masked_fill(torch.ones(6, 6, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
        .logsumexp(-1)
    )
    torch.testing.assert_close(out[..., 0], torch.sigmoid(lse - sinks[None, :, None]))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(chunk_size=2.5), "chunk_size must be a positive int"),
        (dict(chunk_size="8"), "chunk_size must be a positive int"),
        (dict(chunk_size=True), "chunk_size must be a positive int"),
        (dict(sinks=torch.zeros(3)), r"sinks must be a float tensor of shape \(n_heads,\) = \(2,\)"),
        (dict(sinks=torch.zeros(2, dtype=torch.long)), "sinks must be a float tensor"),
    ],
)
def test_clear_errors(kwargs, message):
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match=message):
        attend(q, q, q, **kwargs)


@pytest.mark.parametrize("Sq", [20, 2], ids=["forward-kernel", "decode-kernel"])
def test_triton_skips_key_blocks_outside_the_chunk(Sq):
    """Chunks are a block-skipping range, not only a mask: the queries sit in the last 128-key
    chunk and the earlier keys and values are NaN, so any tile of them read (even under a mask:
    0 * NaN) would poison the output or the gradients. 128 is a multiple of every BLOCK_N."""
    q, k, v, dout, sinks = make(1, 4, 2, Sq, 256, 16, seed=7)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :128], v_nan[:, :, :128] = float("nan"), float("nan")
    fn = lambda *a: attend(*a[:3], sinks=a[3], causal=True, chunk_size=128, backend="triton")
    out, grads = grads_of(fn, q, k_nan, v_nan, sinks, dout)
    ref, ref_grads = grads_of(
        lambda *a: reference(a[0], a[1][:, :, 128:], a[2][:, :, 128:], sinks=a[3], causal=True), q, k, v, sinks, dout
    )
    torch.testing.assert_close(out, ref.float(), atol=2e-4, rtol=2e-4)
    dq, dk, dv, dsinks = grads
    assert (dk[:, :, :128] == 0).all() and (dv[:, :, :128] == 0).all()
    for got, want in ((dq, ref_grads[0]), (dk[:, :, 128:], ref_grads[1][:, :, 128:]), (dsinks, ref_grads[3])):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_triton_op_check_with_sinks_and_chunks():
    from yamlformer.kernels import triton_attention

    q, k, v, _, sinks = make(1, 2, 1, 9, 20, 16)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, None, True, None, None, 0.25)
    torch.library.opcheck(
        triton_attention.flash_attention,
        (*args, None, sinks.requires_grad_(), 4),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_flop_counter_counts_sinks_and_chunks_like_eager():
    """The fused kernel reports the eager matmuls (full (Sq, Sk), forward and backward) whatever
    the chunks skip: the sink column adds no matmul FLOPs."""
    from yamlformer.kernels import triton_attention  # noqa: F401  registers the FLOP formulas before the counter copies them

    q, k, v, _, sinks = make(1, 4, 2, 20, 33, 16)
    counts = {}
    for backend in ("eager", "triton"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        with FlopCounterMode(display=False) as counter:
            attend(*leaves[:3], sinks=leaves[3], causal=True, chunk_size=8, backend=backend).sum().backward()
        counts[backend] = counter.get_total_flops()
    assert counts["eager"] == counts["triton"] == 3 * 4 * 1 * 4 * 20 * 33 * 16


COMPILE_FOR_SM90 = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"  # the compiled kernels, not the interpreter's
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from yamlformer.kernels import flash_backward, flash_backward_dq, flash_decode, flash_forward

FP32 = {"Lse", "Delta", "Sinks", "Alibi", "OPart", "LPart", "DBias"}  # fp32 buffers
INT32 = {"Docs", "DocEnds", "QIdx", "KIdx", "Counter"}
SCALARS = {"H", "GROUP", "SEQ_Q", "SEQ_K", "HEAD_DIM", "HEAD_DIM_V", "SPLIT_LEN", "NUM_SPLITS"}
# what a launch with TMA passes as tensor descriptors, and the rows of their tiles
KV = {"K": "BLOCK_N", "V": "BLOCK_N"}
DESCRIPTORS = {"_attn_fwd": {"Q": "BLOCK_M", **KV}, "_attn_decode": KV, "_attn_bwd_dq": KV,
               "_attn_bwd_dkdv": {"Q": "BLOCK_M", "DO": "BLOCK_M"}}
base = dict(IS_CAUSAL=True, HAS_WINDOW=False, HAS_CHUNK=True, HAS_ALIBI=False, HAS_BIAS=False, HAS_SOFTCAP=False,
            HAS_DOCS=False, HAS_INDEX=False, HAS_SINKS=True, HAS_DBIAS=False, UPCAST=False, DOT_PREC="tf32",
            TMA=False, WARP_SPEC=False, EVEN_D=True, EVEN_DV=True, BLOCK_D=64, BLOCK_DV=64, BLOCK_M=64, BLOCK_N=64)
every = dict(HAS_WINDOW=True, HAS_DOCS=True, HAS_ALIBI=True, HAS_BIAS=True, HAS_SOFTCAP=True, HAS_DBIAS=True,
             EVEN_D=False)
indexed = dict(HAS_INDEX=True, HAS_CHUNK=False, TMA=True)
kernels = [flash_forward._attn_fwd, flash_decode._attn_decode, flash_backward._attn_bwd_dkdv,
           flash_backward_dq._attn_bwd_dq]
for flags in (base, {**base, **every}, {**base, **indexed}, {**base, **every, "TMA": True}):
    for fn in kernels:
        sig, constexprs = {}, {}
        descriptors = DESCRIPTORS[fn.__name__] if flags["TMA"] else {}
        for p in fn.params:
            if p.is_constexpr:
                sig[p.name], constexprs[p.name] = "constexpr", flags[p.name]
                if fn is flash_decode._attn_decode and p.name == "BLOCK_M":
                    constexprs[p.name] = 16  # the packed rows of a decode step
            elif p.name in descriptors:
                sig[p.name] = f"tensordesc<bf16[1,1,{flags[descriptors[p.name]]},{flags['BLOCK_D']}]>"
            elif p.name[0].isupper() and p.name not in SCALARS:
                sig[p.name] = "*fp32" if p.name in FP32 else "*i32" if p.name in INT32 else "*bf16"
            else:
                sig[p.name] = "fp32" if p.name in ("sm_scale", "softcap") else "i32"
        compiled = triton.compile(
            ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2}
        )
        assert compiled.asm["cubin"], fn.__name__
        assert not flags["TMA"] or "cp.async.bulk.tensor" in compiled.asm["ptx"], fn.__name__  # the copy engine
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    """The compiled path (not the interpreter): every kernel with sinks and chunks, alone and with
    every other option, with token indices, through pointers and through tensor descriptors (whose
    loads must become the bulk tensor copy engine's), goes through Triton's whole pipeline to an
    sm_90 cubin (front end, TTGIR, LLVM, ptxas). This catches what the interpreter accepts and the
    compiler does not (scoping, constexpr arithmetic, types); it does not run the kernels."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], check=True, env=env, cwd=Path(__file__).parents[1], timeout=600
    )
