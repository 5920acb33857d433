"""The Triton kernels' tile plan and both load paths, under the interpreter.

Every kernel sweeps a masked range of tiles and an interior one with no mask work at all; these
tests hold the plan to the masks' definition (``attention._visible``): every tile with a visible
pair is swept, the interior is exactly the whole tiles every row sees, and each variant gives the
float64 eager result through pointer loads and through tensor descriptors (TMA), tile shapes
chosen so that interior and boundary tiles both occur."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import attend

from yamlformer.kernels import Mask, tuning
from yamlformer.kernels.attention import _visible, document_starts
from yamlformer.kernels.flash_kernels import _key_ranges, _query_ranges, interpreted, interpreting, tl, triton
from yamlformer.kernels.flash_launch import document_ends


@interpreted(triton.jit)  # a kernel of the test's own: decorated for the interpreter on a CPU
def _plan(Out, Docs, Ends, lo_pos, hi_pos, size, other, window, chunk, QUERIES: tl.constexpr, IS_CAUSAL: tl.constexpr,
          HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_DOCS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    if QUERIES:  # the key tile at lo_pos..hi_pos: query rows (size of them, shift other)
        lo, ilo, ihi, hi = _query_ranges(
            lo_pos,
            hi_pos,
            size,
            other,
            window,
            chunk,
            Docs,
            Ends,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_CHUNK,
            HAS_DOCS,
            False,
            BLOCK,
        )
    else:  # the query tile at positions lo_pos..hi_pos: keys (size of them)
        lo, ilo, ihi, hi = _key_ranges(
            lo_pos, hi_pos, size, window, chunk, Docs, Ends, IS_CAUSAL, HAS_WINDOW, HAS_CHUNK, HAS_DOCS, False, BLOCK
        )
    tl.store(Out, lo)
    tl.store(Out + 1, ilo)
    tl.store(Out + 2, ihi)
    tl.store(Out + 3, hi)


MASKS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window": 37},
    "window-bidirectional": {"window": 21},
    "chunk": {"causal": True, "chunk": 40},
    "documents": {"documents": (30, 45, 5, 48)},
    "documents-causal-window": {"causal": True, "window": 50, "documents": (61, 67)},
}


def _plans(mask, seq_q, seq_k, block):
    """Yield ``(queries, tile, (lo, ilo, ihi, hi), visible)``: the kernels' plan for every query
    tile (keys) and key tile (queries), and the (rows, cols) visibility of that tile's rows."""
    starts = None
    if "documents" in mask:
        ids = torch.repeat_interleave(torch.arange(len(mask["documents"])), torch.tensor(mask["documents"]))[None]
        starts = document_starts(ids)
    options = Mask(causal=mask.get("causal", False), sliding_window=mask.get("window"), chunk_size=mask.get("chunk"))
    keep, _ = _visible(seq_q, seq_k, options, "cpu", starts)
    keep = torch.ones(seq_q, seq_k, dtype=torch.bool) if keep is None else keep.reshape(seq_q, seq_k)
    docs = starts.to(torch.int32) if starts is not None else torch.zeros(1, seq_k, dtype=torch.int32)
    ends = document_ends(docs) if starts is not None else docs
    flags = dict(
        IS_CAUSAL=mask.get("causal", False),
        HAS_WINDOW="window" in mask,
        HAS_CHUNK="chunk" in mask,
        HAS_DOCS=starts is not None,
        BLOCK=block,
    )
    knobs = (mask.get("window", 0), mask.get("chunk", 1))
    shift, out = seq_k - seq_q, torch.zeros(4, dtype=torch.int32)
    for m0 in range(0, seq_q, block):  # query tiles: which keys
        rows = slice(m0, min(m0 + block, seq_q))
        with interpreting():  # and run under it
            _plan[(1,)](out, docs, ends, m0 + shift, rows.stop - 1 + shift, seq_k, 0, *knobs, QUERIES=False, **flags)
        yield False, rows, out.tolist(), keep[rows]
    for n0 in range(0, seq_k, block):  # key tiles: which query rows
        cols = slice(n0, min(n0 + block, seq_k))
        with interpreting():
            _plan[(1,)](out, docs, ends, n0, cols.stop - 1, seq_q, shift, *knobs, QUERIES=True, **flags)
        yield True, cols, out.tolist(), keep[:, cols].T


@pytest.mark.parametrize("lengths", [(128, 128), (50, 128)], ids=["square", "fewer-queries"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_the_interior_is_exactly_the_whole_tiles_every_row_sees(mask, lengths):
    """For every tile of rows: no visible pair outside ``[lo, hi)`` (so skipping is safe), every
    tile of ``[ilo, ihi)`` whole and fully visible (so skipping its mask is safe), and every whole
    fully visible tile inside ``[ilo, ihi)`` (no mask work where none is needed)."""
    block = 16
    for queries, tile, (lo, ilo, ihi, hi), visible in _plans(MASKS[mask], *lengths, block):
        size = visible.shape[1]  # (rows of this tile, the other side's length)
        where = f"{'key' if queries else 'query'} tile {tile}: {(lo, ilo, ihi, hi)}"
        assert 0 <= lo <= ilo <= ihi and lo % block == ilo % block == ihi % block == 0, where
        seen = visible.any(dim=0).nonzero().flatten()
        assert seen.numel() == 0 or (lo <= seen.min() and seen.max() < hi), where
        whole = [t for t in range(0, size - block + 1, block) if visible[:, t : t + block].all()]
        assert all(ilo <= t < ihi for t in whole), where
        assert all(t in whole for t in range(ilo, ihi, block)), where


# ------------------------------------------------------------------------------------------------
# every variant, both load paths
# ------------------------------------------------------------------------------------------------
POINTERS = {
    "fwd": {"BLOCK_M": 32, "BLOCK_N": 16},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 16},
    "dkdv": {"BLOCK_M": 16, "BLOCK_N": 16},
    "decode": {"BLOCK_N": 16, "splits": 5},
}
DESCRIPTORS = {
    "fwd": {"BLOCK_M": 16, "BLOCK_N": 32, "TMA": 1},
    "dq": {"BLOCK_M": 16, "BLOCK_N": 16, "TMA": 1},
    "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "TMA": 1},
    "decode": {"BLOCK_N": 16, "splits": 3, "TMA": 1},
}
# name: (B, H, Hkv, Sq, Sk, D, Dv, options); "bias", "sinks", "alibi", "documents" and "ring"
# (token indices of a wrapped ring buffer with empty slots) are made by _inputs
VARIANTS = {
    "full-gqa": (2, 4, 2, 70, 70, 16, 16, {}),
    "causal-fewer-queries": (1, 2, 1, 40, 70, 16, 16, {"causal": True}),
    "window-alibi-bias-softcap": (
        1,
        4,
        2,
        70,
        70,
        40,
        24,
        {"causal": True, "sliding_window": 37, "alibi": True, "bias": True, "softcap": 3.0},
    ),  # fmt: skip
    "chunk-sinks": (1, 4, 2, 70, 70, 16, 16, {"causal": True, "chunk_size": 24, "sinks": True}),
    "documents": (2, 2, 1, 70, 70, 16, 16, {"documents": True}),
    "documents-causal-window": (2, 2, 1, 70, 70, 16, 16, {"documents": True, "causal": True, "sliding_window": 20}),
    "ring-buffer": (1, 4, 2, 30, 70, 16, 16, {"causal": True, "ring": True, "sliding_window": 40}),
    "decode-sinks-alibi": (2, 8, 2, 1, 90, 16, 16, {"causal": True, "sinks": True, "alibi": True}),
    "decode-ring-buffer": (1, 4, 1, 3, 90, 16, 16, {"causal": True, "ring": True}),
}
QUICK = {  # the default suite: every load path, kernel and mask kind at least once (chunks: test_kernel_sinks_chunks)
    ("window-alibi-bias-softcap", "descriptors"),
    ("documents-causal-window", "pointers"),
    ("ring-buffer", "descriptors"),
    ("decode-sinks-alibi", "descriptors"),
}


def _inputs(B, H, Hkv, Sq, Sk, D, Dv, options):
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (
        torch.randn(s, generator=g) for s in ((B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv), (B, H, Sq, Dv))
    )
    kw = dict(options)
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(1, H, Sq, Sk, generator=g)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(H, generator=g)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(H, generator=g)
    if kw.pop("documents", False):
        lengths = ([25, 30, 15], [8, 62])
        kw["document_ids"] = torch.stack(
            [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
        )
    if kw.pop("ring", False):  # slots hold tokens Sk-1 .. wrapped, the last 6 slots empty
        slots = torch.arange(Sk).roll(Sk // 3)
        kw["token_index"] = (torch.arange(Sk - Sq, Sk), torch.where(slots >= Sk - 6, -1, slots))
    return q, k, v, dout, kw


def _grads(backend, q, k, v, dout, kw, configs=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    extra = {n: (t.clone().requires_grad_() if n in ("bias", "sinks") else t) for n, t in kw.items()}
    with tuning.forced(**(configs or {})):
        out = attend(*leaves, backend=backend, **extra)
    out.backward(dout.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves), *(extra[n].grad for n in ("bias", "sinks") if n in extra)]


@pytest.mark.parametrize(
    "variant,path",
    [
        pytest.param(v, p, marks=() if (v, p) in QUICK else pytest.mark.slow)
        for v in VARIANTS
        for p in ("pointers", "descriptors")
    ],
)
def test_every_variant_matches_float64_through_both_load_paths(variant, path):
    q, k, v, dout, kw = _inputs(*VARIANTS[variant])
    configs = POINTERS if path == "pointers" else DESCRIPTORS
    got = _grads("triton", q, k, v, dout, kw, configs)
    as64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    want = _grads("eager", q.double(), k.double(), v.double(), dout.double(), as64)
    names = ["out", "dq", "dk", "dv", *(n for n in ("bias", "sinks") if n in kw)]
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
