"""Packed documents (``document_ids``): a document packed with others in one row gets exactly the
logits, loss and gradients it gets alone, for every position kind, latent attention and an
encoder, on every attention backend (Triton under the interpreter on a CPU); the kernels against
an explicit-mask float64 reference; and the refusals.

Shapes are small so the interpreter keeps the file well under a minute.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attention_helpers import attend
from torch import nn

from yamlformer.blocks.positions import document_positions
from yamlformer.builder import build_model, load_spec
from yamlformer.builder.spec.schema import spec_model
from yamlformer.kernels.attention import document_starts

torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a shared CPU

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["eager", "sdpa", "triton"]
# two rows of three documents each, of different lengths (the window case's 4 is shorter than most)
ROWS = ([5, 9, 7], [12, 3, 6])


def _decoder(position: dict, **attention_fields):
    """A tiny decoder-only spec: 2 layers, d_model 32, GQA (4 query heads, 2 key/value heads)."""
    return spec_model().model_validate(
        {
            "name": "packed",
            "architecture": "decoder-only",
            "vocab_size": 64,
            "d_model": 32,
            "max_seq_len": 64,
            "position": position,
            "decoder": {
                "n_layers": 2,
                "attention": {"n_heads": 4, "n_kv_heads": 2, **attention_fields},
                "ffn": {"type": "glu", "hidden_dim": 64},
                "norm": {"type": "rmsnorm"},
            },
        }
    )


SPECS = {
    "rope": lambda: _decoder({"type": "rope"}),
    "rope-yarn": lambda: _decoder(
        {"type": "rope", "scaling": {"type": "yarn", "factor": 4.0, "original_max_seq_len": 8}}
    ),
    "rope-llama3": lambda: _decoder(
        {"type": "rope", "scaling": {"type": "llama3", "factor": 8.0, "original_max_seq_len": 8}}
    ),
    "learned": lambda: _decoder({"type": "learned", "max_positions": 64}),
    "sinusoidal": lambda: _decoder({"type": "sinusoidal"}),
    "alibi": lambda: _decoder({"type": "alibi"}),
    "relative-bias": lambda: _decoder({"type": "relative_bias", "num_buckets": 8, "max_distance": 16}),
    "window": lambda: _decoder({"type": "rope"}, sliding_window=4),
    "mla": lambda: load_spec(ROOT / "specs" / "tiny" / "deepseek-v2.yaml"),  # YaRN, MoE
    "encoder": lambda: load_spec(ROOT / "specs" / "tiny" / "bert.yaml"),  # learned positions, MLM head
}
TRITON_CASES = ["rope", "learned", "alibi", "window", "mla", "encoder"]  # the interpreter is slow
#: the Triton case of the default suite (a sliding window under packing);
#: the others run with -m slow
TRITON_DEFAULT = ("window",)
CASES = [
    pytest.param(
        name,
        backend,
        id=f"{name}-{backend}",
        marks=[pytest.mark.slow] if backend == "triton" and name not in TRITON_DEFAULT else [],
    )
    for name in SPECS
    for backend in BACKENDS
    if backend != "triton" or name in TRITON_CASES
]


def _model(name: str, backend: str):
    torch.manual_seed(0)
    spec = SPECS[name]()
    return spec, build_model(spec, attention_backend=backend).eval()  # eval: no dropout; gradients still flow


def _packed(spec):
    """``ids`` and ``document_ids`` ``(2, 21)`` and each document as ``(row, start, length)``."""
    ids = torch.randint(0, spec.vocab_size, (len(ROWS), sum(ROWS[0])), generator=torch.Generator().manual_seed(0))
    documents = torch.stack([torch.repeat_interleave(torch.arange(len(r)) + 3, torch.tensor(r)) for r in ROWS])
    spans = [(row, sum(r[:i]), n) for row, r in enumerate(ROWS) for i, n in enumerate(r)]
    return ids, documents, spans


def _loss(logits: torch.Tensor, ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """One document's loss: next-token prediction in a decoder, every token (MLM) in an encoder."""
    if causal:
        logits, ids = logits[:-1], ids[1:]
    return F.cross_entropy(logits, ids)


@pytest.mark.parametrize("name,backend", CASES)
def test_each_packed_document_gets_the_logits_and_loss_it_gets_alone(name, backend):
    spec, model = _model(name, backend)
    causal = spec.architecture == "decoder-only"
    ids, documents, spans = _packed(spec)
    with torch.no_grad():
        packed = model(ids, document_ids=documents)
        for row, start, n in spans:
            alone = model(ids[row : row + 1, start : start + n])[0]
            torch.testing.assert_close(
                packed[row, start : start + n],
                alone,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, at=(row, start, n): f"document {at}: {m}",
            )
            loss = _loss(packed[row, start : start + n], ids[row, start : start + n], causal)
            torch.testing.assert_close(loss, _loss(alone, ids[row, start : start + n], causal), rtol=1e-5, atol=1e-6)
        # and the documents do separate: the whole row as one document reads across them
        assert not torch.allclose(packed, model(ids), atol=1e-3)


GRAD_CASES = [
    pytest.param(
        name,
        backend,
        id=f"{name}-{backend}",
        marks=[pytest.mark.slow] if backend == "triton" and name != "window" else [],
    )
    for name in ("window", "mla", "encoder")
    for backend in ("eager", "triton")
]


@pytest.mark.parametrize("name,backend", GRAD_CASES)
def test_packed_gradients_are_the_sum_of_each_document_alone(name, backend):
    """Backward through the document mask: the packed batch's summed per-document losses give the
    gradients of the documents' losses taken one by one."""
    spec, model = _model(name, backend)
    causal = spec.architecture == "decoder-only"
    ids, documents, spans = _packed(spec)
    packed = model(ids, document_ids=documents)
    sum(_loss(packed[row, s : s + n], ids[row, s : s + n], causal) for row, s, n in spans).backward()
    together = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for row, s, n in spans:
        _loss(model(ids[row : row + 1, s : s + n])[0], ids[row, s : s + n], causal).backward()
    alone = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert together.keys() == alone.keys() and len(alone) > 10
    for key, grad in alone.items():
        torch.testing.assert_close(together[key], grad, rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_document_per_row_is_no_documents(backend):
    spec, model = _model("window", backend)
    ids, _, _ = _packed(spec)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, document_ids=torch.zeros_like(ids)), model(ids), rtol=1e-6, atol=1e-6)


def test_positions_restart_at_each_document():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [4, 4, 4, 4, 4, 4, 4, 9]])
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0]]
    assert document_starts(documents).tolist() == [[0, 0, 0, 3, 3, 5, 5, 5], [0, 0, 0, 0, 0, 0, 0, 7]]
    assert document_starts(documents).dtype == torch.int32


# ----------------------------------------------------------------------------------------------
# the kernel: document ids against an explicit mask
# ----------------------------------------------------------------------------------------------
def _reference(q, k, v, keep, bias=None, alibi_slopes=None, scale=None):
    """Float64 attention under an explicit boolean ``keep`` ``(B, 1, Sq, Sk)``, from the definition."""
    q, k, v = q.double(), k.double(), v.double()
    _, H, Sq, D = q.shape
    Sk = k.shape[2]
    kv_head = torch.arange(H) // (H // k.shape[1])
    k, v = k[:, kv_head], v[:, kv_head]  # (B, H, Sk, D)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * (1.0 / math.sqrt(D) if scale is None else scale)
    if bias is not None:
        s = s + bias.double()
    if alibi_slopes is not None:
        distance = (torch.arange(Sq)[:, None] + (Sk - Sq)) - torch.arange(Sk)[None, :]
        s = s - alibi_slopes.double()[:, None, None] * distance
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(s, dim=-1), v)


def _explicit_keep(documents, Sq, causal, window):
    """``(B, 1, Sq, Sk)``: same document id (compared directly), causal, window."""
    Sk = documents.shape[1]
    q_pos = torch.arange(Sq)[:, None] + (Sk - Sq)
    distance = q_pos - torch.arange(Sk)[None, :]
    keep = documents[:, -Sq:, None] == documents[:, None, :]
    if causal:
        keep = keep & (distance >= 0)
    if window is not None:
        keep = keep & (distance < window)
    return keep[:, None]


# 70 keys: at the interpreter's 32-wide tiles the last query tile starts its sweep past the first
# key tile (its first document starts at 60) and dk/dv skip query tiles before a document start
KERNEL_CASES = {
    "causal": {"Sq": 70, "causal": True},
    "bidirectional": {"Sq": 70, "causal": False},
    "window": {"Sq": 70, "causal": True, "sliding_window": 8},
    "alibi-bias": {"Sq": 70, "causal": False, "alibi": True, "bias": True},
    "decode": {"Sq": 3, "causal": True},  # few queries: the split-key decode kernel
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_document_mask_matches_an_explicit_mask(case, backend):
    kw = dict(KERNEL_CASES[case])
    Sq, Sk, H, Hkv, D = kw.pop("Sq"), 70, 4, 2, 16  # GQA
    lengths = ([40, 20, 10], [7, 63])
    documents = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, heads, n, D, generator=g) for heads, n in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))
    dout = torch.randn(2, H, Sq, D, generator=g)
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if kw.pop("alibi", False) else None
    bias = torch.randn(1, H, Sq, Sk, generator=g) if kw.pop("bias", False) else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, document_ids=documents, alibi_slopes=alibi, bias=bias, backend=backend, **kw)
    out.backward(dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    keep = _explicit_keep(documents, Sq, kw["causal"], kw.get("sliding_window"))
    ref = _reference(*ref_leaves, keep, bias=bias, alibi_slopes=alibi)
    ref.backward(dout.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(
            leaf.grad.double(), ref_leaf.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}"
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's fixed 32-wide tiles")
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the poisoned rows, as meant
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("poisoned,checked", [("v", "out, dq"), ("q, dout", "dk, dv")])
def test_triton_skips_the_tiles_before_a_document_start(poisoned, checked):
    """Poison (NaN) what the document starts let the kernels skip: a tile that is read, even
    under the mask, spreads it. The last query tile (64..69, its first document starting at 60)
    never reads the key tile 0..31 (forward and dq); the last key tile's dk/dv never read the
    query tile 0..31."""
    from yamlformer.kernels import flash_launch

    assert all(flash_launch.INTERPRET_CONFIGS[k]["BLOCK_M"] == 32 for k in ("fwd", "dq", "dkdv"))
    assert all(flash_launch.INTERPRET_CONFIGS[k]["BLOCK_N"] == 32 for k in ("fwd", "dq", "dkdv"))
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor([40, 20, 10]))[None]
    g = torch.Generator().manual_seed(2)
    tensors = dict(zip(("q", "k", "v", "dout"), (torch.randn(1, 2, 70, 16, generator=g) for _ in range(4))))
    results = []
    for poison in (False, True):
        given = {name: t.clone() for name, t in tensors.items()}
        if poison:
            for name in poisoned.split(", "):
                given[name][:, :, :32] = float("nan")
        leaves = [given[name].requires_grad_() for name in "qkv"]
        out = attend(*leaves, document_ids=documents, backend="triton")  # bidirectional: dk/dv skip too
        out.backward(given["dout"])
        grads = dict(zip(("dq", "dk", "dv"), (leaf.grad for leaf in leaves)), out=out.detach())
        results.append({name: grads[name][:, :, 64:] for name in checked.split(", ")})
    for name in results[0]:
        torch.testing.assert_close(
            results[1][name], results[0][name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


# ----------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------
def _refused(call, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and ("document_ids" in message or "document_masking" in message), message
    return message


def test_refusals_name_document_ids():
    from yamlformer.blocks.generation import KVCache

    spec, model = _model("rope", "eager")
    ids, documents, _ = _packed(spec)
    _refused(lambda: model(ids, document_ids=documents[:, :-1]), r"document_ids has shape \(2, 20\)")
    _refused(lambda: model(ids, document_ids=documents.float()), "document_ids must be an integer tensor")
    _refused(lambda: model(ids, document_ids=documents > 3), "document_ids must be an integer tensor")
    decreasing = documents.clone()
    decreasing[1, 15:] = 0
    _refused(
        lambda: model(ids, document_ids=decreasing), "non-decreasing along each row; row 1 goes from 4 to 0 at token 15"
    )
    cache = KVCache.for_stack(model.decoder, 2, 21, torch.float32, "cpu")
    _refused(lambda: model(ids, document_ids=documents, cache=cache), "document_ids cannot be combined with a KV cache")
    _refused(
        lambda: model(ids, torch.ones_like(ids), document_ids=documents),
        "document_ids cannot be combined with attention_mask",
    )
    t5 = build_model(load_spec(ROOT / "specs" / "tiny" / "t5.yaml"))
    _refused(lambda: t5(ids, decoder_input_ids=ids, document_ids=documents), "not supported by an encoder-decoder")
    with pytest.raises(TypeError, match="document_ids must be a torch.Tensor"):
        model(ids, document_ids=documents.tolist())


def test_an_attention_block_that_does_not_declare_document_masking_is_refused():
    class Undeclared(nn.Module):
        """A plugin attention that has never heard of documents (it would read across them)."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.n_heads = inner, inner.n_heads

        def forward(self, x, inputs, cache=None, memory=None):
            return self.inner(x, inputs, cache=cache, memory=memory)

    spec, model = _model("rope", "eager")
    ids, documents, _ = _packed(spec)
    model.decoder.layers[1].attention = Undeclared(model.decoder.layers[1].attention)
    _refused(lambda: model(ids, document_ids=documents), "Undeclared does not declare document_masking")
    model(ids)  # without documents it runs


def test_kernel_refusals_name_document_ids():
    q = torch.zeros(2, 4, 6, 16)
    k = torch.zeros(2, 2, 6, 16)
    documents = torch.zeros(2, 6, dtype=torch.long)
    _refused(lambda: attend(q, k, k, document_ids=documents[:, :5]), r"document_ids must be a \(batch, seq_k\)")
    _refused(lambda: attend(q, k, k, document_ids=documents.double()), "document_ids must be an integer tensor")
    index = (torch.arange(6), torch.arange(6))
    _refused(lambda: attend(q, k, k, document_ids=documents, token_index=index), "cannot be combined with token_index")
