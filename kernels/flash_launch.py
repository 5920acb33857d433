"""Launches of the Triton attention kernels: the arguments every launch shares (:func:`prepare`),
tensor descriptors where the GPU and the tensors allow them, launch configs
(:mod:`yamlformer.kernels.tuning`; fixed ones under the interpreter) and one function per kernel:
:func:`forward`, :func:`decode`, :func:`backward_dq` (which also computes ``Delta``) and
:func:`backward_dkdv`. :mod:`yamlformer.kernels.triton_attention` composes them into the custom op;
``benchmarks/attention.py --sweep`` times them one config at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import tuning
from .flash_backward import _attn_bwd_dkdv
from .flash_backward_dq import _attn_bwd_dq
from .flash_decode import _attn_decode
from .flash_forward import _attn_fwd
from .flash_kernels import DECORATING, INTERPRET, interpreted, triton
from .masks import Mask

DECORATING.__exit__(None, None, None)  # every kernel module is decorated: the environment as it was

try:  # Triton >= 3.4: host-side tensor descriptors (the Hopper bulk tensor copy engine)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads everywhere
    TensorDescriptor = None

# Under the interpreter: fixed 32-wide tiles keep it fast enough while still exercising several
# tiles (interior and boundary) and masked tails at test lengths (17..100); four decode splits.
INTERPRET_CONFIGS = {
    "fwd": {"BLOCK_M": 32, "BLOCK_N": 32},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 32},
    "dkdv": {"BLOCK_M": 32, "BLOCK_N": 32},
    "decode": {"BLOCK_N": 32, "splits": 4},
}
# What `benchmarks/attention.py --sweep --cpu` times under the interpreter: the fixed configs and
# one with tensor descriptors and other tile shapes, so both load paths run.
INTERPRET_CANDIDATES = {
    "fwd": [INTERPRET_CONFIGS["fwd"], {"BLOCK_M": 16, "BLOCK_N": 32, "TMA": 1}],
    "dq": [INTERPRET_CONFIGS["dq"], {"BLOCK_M": 16, "BLOCK_N": 16, "TMA": 1}],
    "dkdv": [INTERPRET_CONFIGS["dkdv"], {"BLOCK_M": 16, "BLOCK_N": 32, "TMA": 1}],
    "decode": [INTERPRET_CONFIGS["decode"], {"BLOCK_N": 16, "splits": 3, "TMA": 1}],
}
# The decode kernel takes few query rows (all heads of a kv group packed in one tile) and a cache.
DECODE_MAX_SEQ_Q = 16
DECODE_MAX_ROWS = 64
# each kernel's tiles for the shared-memory estimate (tuning.smem_bytes): the rows held for the
# whole program, whether a value-wide tile is held too, the rows streamed through the loop
TILES = {"fwd": ("M", False, "N"), "dq": ("M", True, "N"), "dkdv": ("N", True, "M"), "decode": ("M", False, "N")}


@dataclass
class Call:
    """What every launch of one attention call shares."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    reads: tuple  # bias, alibi slopes, document starts and ends, query and key indices
    bias_strides: tuple  # the bias view's four strides, then the document rows'
    sizes: tuple  # H, GROUP, SEQ_Q, SEQ_K, HEAD_DIM, HEAD_DIM_V
    knobs: tuple  # scale, softcap, window, chunk
    flags: dict  # the kernels' shared constexprs
    sinks: torch.Tensor | None

    @property
    def decodes(self) -> bool:
        """Whether the forward takes the split-K decode kernel: few query rows per kv head."""
        H, group, seq_q = self.sizes[:3]
        return seq_q <= DECODE_MAX_SEQ_Q and group * seq_q <= DECODE_MAX_ROWS

    @property
    def decode_rows(self) -> int:
        """The decode kernel's query tile: every query row of one kv head, at least 16."""
        return max(16, triton.next_power_of_2(self.sizes[1] * self.sizes[2]))

    def key(self, kernel: str) -> str:
        """The tuning key of ``kernel`` for this call (:func:`yamlformer.kernels.tuning.shape_key`;
        a decode key also tells apart its query tile and the kv heads the grid spreads over)."""
        f, (_, _, seq_q, seq_k, _, _) = self.flags, self.sizes
        ranged = f["HAS_WINDOW"] or f["HAS_CHUNK"] or f["HAS_DOCS"] or f["HAS_INDEX"]
        scored = f["HAS_ALIBI"] or f["HAS_BIAS"] or f["HAS_SOFTCAP"]
        kind = (self.q.dtype, f["BLOCK_D"], f["BLOCK_DV"], f["IS_CAUSAL"], ranged, scored)
        if kernel != "decode":
            return tuning.shape_key(*kind, seq_q, seq_k)
        programs = self.k.shape[0] * self.k.shape[1]
        return tuning.shape_key(*kind, seq_k) + f" rows{self.decode_rows} kv{tuning.length_bucket(programs)}"


def document_ends(starts: torch.Tensor) -> torch.Tensor:
    """``(batch, seq)`` int32 index one past each token's document, for the starts
    ``masks.document_starts`` gives (``[0, 0, 0, 3, 3, 5]`` -> ``[3, 3, 3, 5, 5, 6]``)."""
    batch, seq = starts.shape
    index = torch.arange(seq, dtype=torch.int32, device=starts.device).expand(batch, seq)
    begins = torch.where(starts == index, index, seq)  # (batch, seq): where a document begins
    following = torch.cat((begins[:, 1:], begins.new_full((batch, 1), seq)), dim=1)
    return following.flip(1).cummin(dim=1).values.flip(1).to(torch.int32).contiguous()


def prepare(q, k, v, mask: Mask, scale: float, document_starts=None) -> Call:
    """One call's launch arguments from its ``mask`` (its ``document_ids`` unread: the kernels take
    ``document_starts`` (B, Sk), ``yamlformer.kernels.masks.document_starts`` of them)."""
    bias, alibi_slopes, causal, sliding_window = mask.bias, mask.alibi_slopes, mask.causal, mask.sliding_window
    softcap, sinks, chunk_size = mask.softcap, mask.sinks, mask.chunk_size
    query_index, key_index = mask.token_index if mask.token_index is not None else (None, None)
    B, H, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if bias is not None:
        bias_arg = bias.expand(B, H, Sq, Sk)  # stride 0 on broadcast dims, no copy
        bias_strides = tuple(bias_arg.stride())
    else:
        bias_arg, bias_strides = q, (0, 0, 0, 0)  # never read: HAS_BIAS=False
    alibi_arg = alibi_slopes.contiguous() if alibi_slopes is not None else q
    if document_starts is not None:
        docs_arg = document_starts.to(torch.int32).contiguous()  # (B, Sk)
        ends_arg, doc_stride = document_ends(docs_arg), docs_arg.stride(0)
    else:
        docs_arg, ends_arg, doc_stride = q, q, 0  # never read: HAS_DOCS=False
    indexed = query_index is not None
    qidx_arg = query_index.to(torch.int32).contiguous() if indexed else q
    kidx_arg = key_index.to(torch.int32).contiguous() if indexed else q
    block_d, block_dv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))
    flags = dict(
        IS_CAUSAL=bool(causal),
        HAS_WINDOW=sliding_window is not None,
        HAS_CHUNK=chunk_size is not None,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_DOCS=document_starts is not None,
        HAS_INDEX=indexed,
        UPCAST=INTERPRET and q.dtype != torch.float32,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        EVEN_D=block_d == D,
        EVEN_DV=block_dv == Dv,
    )
    return Call(
        q=q,
        k=k,
        v=v,
        reads=(bias_arg, alibi_arg, docs_arg, ends_arg, qidx_arg, kidx_arg),
        bias_strides=(*bias_strides, doc_stride),
        sizes=(H, H // Hkv, Sq, Sk, D, Dv),
        knobs=(float(scale), float(softcap or 0.0), int(sliding_window or 0), int(chunk_size or 1)),
        flags=flags,
        sinks=sinks.float().contiguous() if sinks is not None else None,
    )


# ----------------------------------------------------------------------------------------------
# configs and descriptors
# ----------------------------------------------------------------------------------------------
def config(kernel: str, call: Call, key: str, run) -> dict:
    """The launch config of ``kernel`` for this call: forced (the sweep), fixed (interpreter), or
    :func:`yamlformer.kernels.tuning.choose`'s."""
    forced = tuning.forced_config(kernel)
    if forced is not None:
        return forced
    if INTERPRET:
        return INTERPRET_CONFIGS[kernel]
    return tuning.choose(kernel, key, call.q.device, run, lambda c: eligible(kernel, call, c))


def eligible(kernel: str, call: Call, cfg: dict) -> bool:
    """Whether ``cfg`` may run ``kernel`` for this call on its GPU: its estimated shared memory
    fits, tensor descriptors only from sm_90 on, and no query tile taller than the queries."""
    gen, _, _, smem = tuning.device_facts(call.q.device)
    f, (_, _, seq_q, seq_k, _, _) = call.flags, call.sizes
    need = tuning.smem_bytes(cfg, call.q.element_size(), f["BLOCK_D"], f["BLOCK_DV"], TILES[kernel])
    if need > smem or (cfg.get("TMA") and gen != "sm_90"):
        return False
    if kernel in ("fwd", "dq"):
        return cfg["BLOCK_M"] <= max(16, triton.next_power_of_2(seq_q))
    if kernel == "dkdv":
        return cfg["BLOCK_N"] <= max(16, triton.next_power_of_2(seq_k))
    return True


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a 4-D tensor can be read through a tensor descriptor: unit last stride, 16-byte
    aligned start and strides."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1])


def _sources(cfg: dict, tiles: dict) -> tuple[bool, dict]:
    """``(TMA, {name: tensor or descriptor})``: descriptors of ``tiles`` (name -> (tensor, rows,
    cols) of one tile) where the config asks for them and every tensor allows them."""
    tensors = {name: t for name, (t, _, _) in tiles.items()}
    if not cfg.get("TMA") or TensorDescriptor is None or not all(_tma_ready(t) for t in tensors.values()):
        return False, tensors
    if not INTERPRET and torch.cuda.get_device_capability(next(iter(tensors.values())).device)[0] < 9:
        return False, tensors
    descs = {
        name: TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])
        for name, (t, rows, cols) in tiles.items()
    }
    return True, descs


def _options(cfg: dict) -> dict:
    return {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 2)}


def _strides(t: torch.Tensor) -> tuple:
    return tuple(t.stride())


# ----------------------------------------------------------------------------------------------
# launches
# ----------------------------------------------------------------------------------------------
@interpreted
def forward(call: Call, out: torch.Tensor, lse: torch.Tensor, cfg: dict | None = None) -> None:
    """The forward kernel into ``out`` and ``lse`` (``cfg``: None chooses)."""
    H, group, seq_q, seq_k, _, _ = call.sizes
    if cfg is None:
        cfg = config("fwd", call, call.key("fwd"), lambda c: forward(call, out, lse, c))
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    f = call.flags
    tma, src = _sources(
        cfg, {"q": (call.q, bm, f["BLOCK_D"]), "k": (call.k, bn, f["BLOCK_D"]), "v": (call.v, bn, f["BLOCK_DV"])}
    )
    sinks = call.sinks if call.sinks is not None else lse  # never read without HAS_SINKS
    grid = (triton.cdiv(seq_q, bm), call.q.shape[0] * H)
    _attn_fwd[grid](
        src["q"],
        src["k"],
        src["v"],
        out,
        lse,
        *call.reads,
        sinks,
        *_strides(call.q),
        *_strides(call.k),
        *_strides(call.v),
        *_strides(out),
        *call.bias_strides,
        *call.sizes,
        *call.knobs,
        **f,
        HAS_SINKS=call.sinks is not None,
        TMA=tma,
        WARP_SPEC=tma and bool(cfg.get("WARP_SPEC")),
        BLOCK_M=bm,
        BLOCK_N=bn,
        **_options(cfg),
    )


def decode_split(call: Call, cfg: dict) -> tuple[int, int]:
    """``(splits, split length)`` of the cache for a decode launch with ``cfg``."""
    B, Hkv, seq_k = call.k.shape[0], call.k.shape[1], call.sizes[3]
    bn = cfg["BLOCK_N"]
    if "splits" in cfg:  # a fixed count (the interpreter's, tests)
        split_len = max(bn, triton.cdiv(triton.cdiv(seq_k, cfg["splits"]), bn) * bn)
        return triton.cdiv(seq_k, split_len), split_len
    sms = tuning.device_facts(call.q.device)[2]
    return tuning.decode_splits(seq_k, B * Hkv, sms, cfg.get("waves", 2), bn)


@interpreted
def decode(call: Call, out: torch.Tensor, lse: torch.Tensor, cfg: dict | None = None) -> None:
    """The split-K decode kernel into ``out`` and ``lse`` (``cfg``: None chooses)."""
    H, group, seq_q, seq_k, _, dv = call.sizes
    B, Hkv = call.k.shape[0], call.k.shape[1]
    if cfg is None:
        cfg = config("decode", call, call.key("decode"), lambda c: decode(call, out, lse, c))
    bn = cfg["BLOCK_N"]
    splits, split_len = decode_split(call, cfg)
    f = call.flags
    tma, src = _sources(cfg, {"k": (call.k, bn, f["BLOCK_D"]), "v": (call.v, bn, f["BLOCK_DV"])})
    o_part = torch.empty((B * H * seq_q, splits, dv), dtype=torch.float32, device=call.q.device)
    l_part = torch.empty((B * H * seq_q, splits), dtype=torch.float32, device=call.q.device)
    counter = torch.zeros((B * Hkv,), dtype=torch.int32, device=call.q.device)
    sinks = call.sinks if call.sinks is not None else lse  # never read without HAS_SINKS
    _attn_decode[(splits, B * Hkv)](
        call.q,
        src["k"],
        src["v"],
        out,
        lse,
        o_part,
        l_part,
        counter,
        *call.reads,
        sinks,
        *_strides(call.q),
        *_strides(call.k),
        *_strides(call.v),
        *_strides(out),
        *call.bias_strides,
        *call.sizes,
        *call.knobs,
        split_len,
        splits,
        **f,
        HAS_SINKS=call.sinks is not None,
        TMA=tma,
        WARP_SPEC=tma and bool(cfg.get("WARP_SPEC")),
        BLOCK_M=call.decode_rows,
        BLOCK_N=bn,
        **_options(cfg),
    )


@interpreted
def backward_dq(call, grad_out, out, lse, delta, dq, cfg: dict | None = None) -> None:
    """dQ into ``dq`` and ``rowsum(dO * O)`` into ``delta`` (``cfg``: None chooses)."""
    H, group, seq_q, seq_k, _, _ = call.sizes
    if cfg is None:
        run = lambda c: backward_dq(call, grad_out, out, lse, delta, dq, c)
        cfg = config("dq", call, call.key("dq"), run)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    f = call.flags
    tma, src = _sources(cfg, {"k": (call.k, bn, f["BLOCK_D"]), "v": (call.v, bn, f["BLOCK_DV"])})
    grid = (triton.cdiv(seq_q, bm), call.q.shape[0] * H)
    _attn_bwd_dq[grid](
        call.q,
        src["k"],
        src["v"],
        out,
        grad_out,
        lse,
        delta,
        dq,
        *call.reads,
        *_strides(call.q),
        *_strides(call.k),
        *_strides(call.v),
        *_strides(grad_out),
        *_strides(out),
        *call.bias_strides,
        *call.sizes,
        *call.knobs,
        **f,
        TMA=tma,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **_options(cfg),
    )


@interpreted
def backward_dkdv(call, grad_out, lse, delta, dk, dv, dbias, cfg: dict | None = None) -> None:
    """dK, dV into ``dk``, ``dv`` (and the scores' gradient into ``dbias`` when it is not empty);
    ``delta`` as :func:`backward_dq` left it (``cfg``: None chooses)."""
    H, group, seq_q, seq_k, _, _ = call.sizes
    if cfg is None:
        run = lambda c: backward_dkdv(call, grad_out, lse, delta, dk, dv, dbias, c)
        cfg = config("dkdv", call, call.key("dkdv"), run)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    f = call.flags
    tma, src = _sources(cfg, {"q": (call.q, bm, f["BLOCK_D"]), "do": (grad_out, bm, f["BLOCK_DV"])})
    grid = (triton.cdiv(seq_k, bn), call.k.shape[0] * call.k.shape[1])
    _attn_bwd_dkdv[grid](
        src["q"],
        call.k,
        call.v,
        src["do"],
        lse,
        delta,
        dk,
        dv,
        dbias,
        *call.reads,
        *_strides(call.q),
        *_strides(call.k),
        *_strides(call.v),
        *_strides(grad_out),
        *call.bias_strides,
        *call.sizes,
        *call.knobs,
        **f,
        HAS_DBIAS=dbias.numel() > 0,
        TMA=tma,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **_options(cfg),
    )
