"""The per-layer options of ``multi_head`` attention (issue 26) beyond what the registry-wide
tests check for every example (counts, FLOPs, the JSON Schema, cached == recomputed greedy
decoding): ``qk_norm``, ``sinks``, ``chunk_size``, ``rope: false``, ``rope_theta`` and
``temperature_tuning``, each against attention written out plainly here (an explicit softmax
with the sink logit concatenated, a mask built pair by pair) and against the Hugging Face
pieces they follow; cached decoding in pieces, through a ring buffer and by the static step;
the exact parameter, pair and saved-activation counts; the located errors; and (slow, two CPU
processes) tensor parallelism."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from sharded_helpers import end_process_group

from yamlformer.blocks.attention import AttentionInputs
from yamlformer.blocks.build import Dims, build_block
from yamlformer.blocks.cache import KVCache
from yamlformer.blocks.configs.attention import AttentionConfig
from yamlformer.blocks.configs.pairs import visible_pairs
from yamlformer.blocks.configs.position import RopeConfig
from yamlformer.blocks.init import init_weights
from yamlformer.blocks.positions import Rope
from yamlformer.builder import build_model, load_spec
from yamlformer.builder.analysis.layout import tensor_parallel_problems
from yamlformer.builder.spec.loader import SpecError
from yamlformer.kernels import Mask
from yamlformer.kernels import attention as attention_kernel

torch.set_num_threads(1)

D, B, S = 32, 2, 11
DIMS = Dims(d_model=D, vocab_size=50, max_seq_len=64)

#: (id, fields) the numerics are checked for: the families each option comes from, and mixtures
CASES = {
    "qwen3": {"n_heads": 4, "n_kv_heads": 2, "qk_norm": {}},
    "gemma3-local": {"n_heads": 4, "head_dim": 12, "qk_norm": {"unit_offset": True}, "rope_theta": 100.0},
    "olmo2": {"n_heads": 4, "n_kv_heads": 2, "qk_norm": {"over": "projection", "eps": 1e-5}},
    "gpt-oss": {"n_heads": 4, "n_kv_heads": 2, "sinks": True, "sliding_window": 4, "qkv_bias": True},
    "llama4-rope": {"n_heads": 4, "n_kv_heads": 2, "chunk_size": 4, "qk_norm": {"type": "l2"}},
    "llama4-nope": {
        "n_heads": 4,
        "n_kv_heads": 2,
        "rope": False,
        "temperature_tuning": {"floor_scale": 3, "scale": 0.5},
    },
    "everything": {
        "n_heads": 4,
        "n_kv_heads": 1,
        "sinks": True,
        "chunk_size": 5,
        "sliding_window": 3,
        "softcap": 10.0,
        "qk_norm": {"over": "projection", "unit_offset": True},
        "temperature_tuning": {"floor_scale": 2, "scale": 0.2},
    },
}


def _config(fields: dict) -> AttentionConfig:
    return AttentionConfig.model_validate(fields)


def _block(fields: dict, causal: bool = True, backend: str = "eager", seed: int = 0):
    """The block, its norm weights and sinks drawn away from their initial values."""
    config = _config(fields)
    torch.manual_seed(seed)
    module = init_weights(build_block(config, DIMS, causal=causal, backend=backend)).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name == "sinks":
                p.normal_(0.0, 0.5)
    return config, module


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE, GPT-NeoX layout, written out: pairs (i, i + d/2) turned by position / theta^(2i/d)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None, :, None] * inv_freq  # (batch, 1, seq, d/2)
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _rms(x: torch.Tensor, weight, eps: float, unit_offset: bool) -> torch.Tensor:
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed
    return normed * ((1.0 + weight) if unit_offset else weight)


def _reference(module, config: AttentionConfig, x: torch.Tensor, positions, causal: bool, theta: float):
    """The block's forward written out in float64, pair by pair where the masks are concerned."""
    P = {name: p.double() for name, p in module.named_parameters()}
    x = x.double()
    batch, seq, _ = x.shape
    H, KV, hd = config.n_heads, config.n_kv_heads, module.head_dim

    def project(name):
        y = x @ P[f"{name}_proj.weight"].T
        return y + P[f"{name}_proj.bias"] if f"{name}_proj.bias" in P else y

    q, k, v = project("q"), project("k"), project("v")
    norm = config.qk_norm

    def normed(y, which, heads):
        if norm is None:
            return y.view(batch, seq, heads, hd)
        weight = P.get(f"{which}_norm.weight")
        if norm.over == "projection":
            return _rms(y, weight, norm.eps, norm.unit_offset).view(batch, seq, heads, hd)
        return _rms(y.view(batch, seq, heads, hd), weight, norm.eps, norm.unit_offset)

    q = normed(q, "q", H).transpose(1, 2)  # (batch, H, seq, hd)
    k = normed(k, "k", KV).transpose(1, 2)
    v = v.view(batch, seq, KV, hd).transpose(1, 2)
    if config.rope:
        base = config.rope_theta if config.rope_theta is not None else theta
        q, k = _rotate(q, positions, base), _rotate(k, positions, base)
    if config.temperature_tuning is not None:
        t = config.temperature_tuning
        factor = torch.log(torch.floor((positions.double() + 1) / t.floor_scale) + 1) * t.scale + 1
        q = q * factor[:, None, :, None]
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = q @ k.transpose(-1, -2) * (config.scale if config.scale is not None else hd**-0.5)
    if config.softcap is not None:
        scores = config.softcap * torch.tanh(scores / config.softcap)
    keep = torch.ones(seq, seq, dtype=torch.bool)
    for i in range(seq):
        for j in range(seq):
            if causal and j > i:
                keep[i, j] = False
            if config.sliding_window is not None and i - j >= config.sliding_window:
                keep[i, j] = False
            if config.chunk_size is not None and i // config.chunk_size != j // config.chunk_size:
                keep[i, j] = False
    scores = scores.masked_fill(~keep, float("-inf"))
    if config.sinks:  # GPT-OSS's eager_attention_forward: the sink column joins the softmax, then goes
        column = P["sinks"].view(1, H, 1, 1).expand(batch, H, seq, 1)
        logits = torch.cat((scores, column), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(batch, seq, H * hd)
    out = out @ P["out_proj.weight"].T
    return out + P["out_proj.bias"] if "out_proj.bias" in P else out


@pytest.mark.parametrize("backend", ["eager", "sdpa", "triton"])  # triton: the interpreter on a CPU
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_option_computes_what_it_says(name, causal, backend):
    config, module = _block(CASES[name], causal=causal, backend=backend)
    rope = Rope(RopeConfig(theta=1000.0))
    positions = torch.arange(3, 3 + S).expand(B, S)  # not from 0: the temperature's floor steps show
    x = torch.randn(B, S, D)
    with torch.no_grad():
        out = module(x, AttentionInputs(0, S, positions=positions, position=rope))
    want = _reference(module, config, x, positions, causal, theta=1000.0)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "triton"])
@pytest.mark.parametrize("name", ["everything", "gpt-oss", "olmo2", "gemma3-local"])
def test_each_option_trains_as_written(name, backend):
    """The gradients of every parameter (the norm weights and sinks included) and of the input
    are the written-out attention's."""
    config, module = _block(CASES[name], backend=backend)
    rope = Rope(RopeConfig(theta=1000.0))
    positions = torch.arange(S).expand(B, S)
    x = torch.randn(B, S, D, requires_grad=True)
    module(x, AttentionInputs(0, S, positions=positions, position=rope)).pow(2).sum().backward()
    ours = [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]
    x.grad = None
    module.zero_grad()
    _reference(module, config, x, positions, True, theta=1000.0).pow(2).sum().backward()
    want = [x.grad] + [p.grad for p in module.parameters()]
    for (pname, _), got, expected in zip([("x", x), *module.named_parameters()], ours, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=pname)


def test_the_norms_are_hugging_faces():
    """q_norm / k_norm against transformers' own modules: Qwen3's RMSNorm (weight), Gemma 3's
    (1 + weight), OLMo 2's over the whole projection and Llama 4's weightless L2 norm; in bf16
    too for the ones that multiply the weight in fp32, as ours does."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x = torch.randn(B, S, 4, 8)
    pairs = [
        ({"qk_norm": {}}, Qwen3RMSNorm(8, eps=1e-6), (torch.float32,)),
        ({"qk_norm": {"unit_offset": True}}, Gemma3RMSNorm(8, eps=1e-6), (torch.float32, torch.bfloat16)),
        ({"qk_norm": {"over": "projection"}}, Olmo2RMSNorm(32, eps=1e-6), (torch.float32, torch.bfloat16)),
        ({"qk_norm": {"type": "l2"}}, Llama4TextL2Norm(1e-6), (torch.float32, torch.bfloat16)),
    ]
    for fields, theirs, dtypes in pairs:
        _, module = _block({"n_heads": 4, **fields})
        ours = module.q_norm
        if ours.weight is not None:
            theirs.weight.data.copy_(ours.weight.data)
        for dtype in dtypes:
            ours_in = x.to(dtype) if ours.weight is None or ours.weight.shape[0] == 8 else x.flatten(-2).to(dtype)
            torch.testing.assert_close(ours.to(dtype)(ours_in), theirs.to(dtype)(ours_in), rtol=0, atol=0)


def test_sinks_are_gpt_oss_eager_attention():
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(B, 4, S, 8), torch.randn(B, 2, S, 8), torch.randn(B, 2, S, 8)
    sinks = torch.randn(4) * 2
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]  # causal, additive
    theirs, _ = eager_attention_forward(
        SimpleNamespace(sinks=sinks, num_key_value_groups=2, training=False), q, k, v, mask, scaling=8**-0.5
    )
    for backend in ("eager", "sdpa"):
        ours = attention_kernel(q, k, v, Mask(causal=True, sinks=sinks), backend=backend)
        torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=1e-5, atol=1e-6)


def test_a_layers_rope_theta_rotates_at_that_base_without_the_blocks_scaling():
    scaled = Rope(RopeConfig(theta=10000.0, scaling={"type": "linear", "factor": 8.0}))
    plain = Rope(RopeConfig(theta=500.0))
    q, k = torch.randn(B, 4, S, 16), torch.randn(B, 2, S, 16)
    positions = torch.arange(S).expand(B, S)
    at_base = AttentionInputs(0, S, positions=positions, position=scaled).rotate(q, k, theta=500.0)
    for ours, want in zip(at_base, plain.rotate(q, k, positions)):
        torch.testing.assert_close(ours, want)
    own = scaled.rotate(q, k, positions)  # the block's own rotation is still scaled (and memoised apart)
    assert not torch.allclose(own[0], at_base[0])
    torch.testing.assert_close(scaled.rotate(q, k, positions, theta=500.0)[0], at_base[0])
    # nor the score factor of DeepSeek's YaRN: the layer computes what it computes under plain RoPE
    _, module = _block({"n_heads": 4, "rope_theta": 500.0})
    yarn = {"type": "yarn", "factor": 4.0, "original_max_seq_len": 8, "mscale": 1.0, "mscale_all_dim": 1.0}
    x = torch.randn(B, S, D)
    with torch.no_grad():
        outs = [
            module(x, AttentionInputs(0, S, positions=positions, position=Rope(RopeConfig(**fields))))
            for fields in ({"theta": 10000.0, "scaling": yarn}, {"theta": 500.0})
        ]
    assert Rope(RopeConfig(scaling=yarn)).score_scale() != 1.0
    torch.testing.assert_close(outs[0], outs[1])


# -- decoding ------------------------------------------------------------------------------------


def _spec(attention: dict, overrides=(), position=None, n_layers: int = 2) -> dict:
    return {
        "name": "options",
        "architecture": "decoder-only",
        "vocab_size": 64,
        "d_model": D,
        "max_seq_len": 64,
        "position": position or {"type": "rope"},
        "decoder": {
            "n_layers": n_layers,
            "attention": attention,
            "ffn": {"type": "glu", "hidden_dim": 48},
            "norm": {"type": "rmsnorm"},
            "overrides": list(overrides),
        },
    }


#: Llama 4's pattern (chunked RoPE layers with an L2 norm, a NoPE layer with temperature tuning),
#: Gemma 3's (local layers at their own base, windowed) with GPT-OSS's sinks
DECODERS = {
    "llama4": _spec(
        {"n_heads": 4, "n_kv_heads": 2, "chunk_size": 4, "qk_norm": {"type": "l2"}},
        [
            {
                "layers": [2],
                "attention": {
                    "chunk_size": None,
                    "qk_norm": None,
                    "rope": False,
                    "temperature_tuning": {"floor_scale": 4, "scale": 0.1},
                },
            }
        ],
        n_layers=3,
    ),
    "gemma3-gpt-oss": _spec(
        {"n_heads": 4, "n_kv_heads": 2, "qk_norm": {"unit_offset": True}, "sinks": True},
        [{"layers": [0], "attention": {"sliding_window": 5, "rope_theta": 100.0}}],
        position={"type": "rope", "theta": 1e6, "scaling": {"type": "linear", "factor": 4.0}},
    ),
    "chunks-in-a-ring": _spec({"n_heads": 4, "chunk_size": 6, "sliding_window": 4, "qk_norm": {"over": "projection"}}),
}


def _model(name: str, backend: str = "eager"):
    spec = load_spec(DECODERS[name])
    torch.manual_seed(0)
    model = build_model(spec, attention_backend=backend).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("sinks"):
                p.normal_(0.0, 0.5)
    return spec, model


def _pieces(model, ids, mask=None):
    """Prefill 5, then pieces of 3 and 1 tokens, each through the cache (a windowed layer's ring
    buffer wraps: its keys no longer start at token 0)."""
    cache = KVCache.for_stack(model.decoder, ids.shape[0], ids.shape[1], torch.float32, "cpu")
    pieces, at = [], 0
    for n in (5, 3, 3, 1, 1, 3, 4):
        pieces.append(model(ids[:, at : at + n], None if mask is None else mask[:, : at + n], cache=cache))
        at += n
    return torch.cat(pieces, dim=1)


def _steps(model, ids, mask=None, prefill: int = 6):
    """The static decoding step from token ``prefill`` on, over an eagerly prefilled cache."""
    rows, total = ids.shape
    cache = KVCache.for_stack(model.decoder, rows, total, torch.float32, "cpu")
    model(ids[:, :prefill], None if mask is None else mask[:, :prefill], cache=cache)
    if mask is None:
        positions = torch.arange(total).expand(rows, total)
    else:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
    steps = []
    for i in range(prefill, total):
        steps.append(model._decode_step(ids[:, i : i + 1], torch.tensor([i]), positions, cache, mask, None, None))
        cache.advance(1)
    return torch.stack(steps, dim=1)


@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=pytest.mark.slow)])  # interpreted: minutes
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_cached_pieces_and_static_steps_equal_the_full_forward(name, backend):
    """Cached pieces and static steps give the full forward's logits, with and without a
    left-padded row; greedy decoding with the cache equals recomputation."""
    _, model = _model(name, backend)
    ids = torch.randint(0, 64, (B, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(B, 20, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        for m in (None, mask):
            full = model(ids, m)
            torch.testing.assert_close(_pieces(model, ids, m), full, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(_steps(model, ids, m), full[:, 6:], rtol=1e-4, atol=1e-5)
    prompt = ids[:, :4]
    assert torch.equal(model.generate(prompt, 10), model.generate(prompt, 10, use_cache=False))


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_left_padding_leaves_the_real_tokens_alone(name):
    """Chunks and the temperature follow position ids: a row padded on the left computes, on its
    real tokens, what it computes unpadded, in the full forward, cached pieces and static steps
    (Hugging Face's Llama 4 counts chunks from the first real token too)."""
    _, model = _model(name)
    ids = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(6))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids), dim=1)
    mask = torch.cat((torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 17, dtype=torch.long)), dim=1)
    with torch.no_grad():
        alone = model(ids)
        torch.testing.assert_close(model(padded, mask)[:, 3:], alone, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(_pieces(model, padded, mask)[:, 3:], alone, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(_steps(model, padded, mask, prefill=9), alone[:, 6:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "triton"])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_a_packed_document_gets_what_it_gets_alone(name, backend):
    """``document_ids``: each document's chunks start at its own first token, its temperature
    counts its own positions; so its logits are those of the document run alone."""
    _, model = _model(name, backend)
    lengths = (7, 2, 9)
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(7))
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(ids, document_ids=documents)
        alone = torch.cat([model(part) for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


def test_the_static_decoding_step_is_one_graph_with_every_option():
    """``generate(compile=True)`` traces one graph: no option breaks it (chunks and the
    temperature read the step's position tensors, the sinks a parameter slice)."""
    from yamlformer.blocks import generation

    for name in ("llama4", "gemma3-gpt-oss"):
        _, model = _model(name)
        ids = torch.randint(0, 64, (B, 8), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            cache = KVCache.for_stack(model.decoder, B, 8, torch.float32, "cpu")
            model(ids[:, :7], cache=cache)
            positions = torch.arange(8).expand(B, 8)
            torch._dynamo.reset()
            explained = torch._dynamo.explain(generation._compiled_decode_step)(
                model, ids[:, 7:8].contiguous(), torch.tensor([7]), positions, cache, None, None, None
            )
        torch._dynamo.reset()
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
            r.reason for r in explained.break_reasons
        ]


def test_the_kv_cache_layout_is_unchanged_by_the_options():
    plain = _config({"n_heads": 4, "n_kv_heads": 2})
    for fields in CASES.values():
        config = _config(fields)
        if config.n_kv_heads == 2 and config.sliding_window is None:
            assert config.kv_cache(D) == plain.kv_cache(D)  # a chunked layer keeps every token too


# -- counts --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_params_and_shapes_are_the_modules(name):
    config, module = _block(CASES[name])
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == config.param_shapes(D)
    assert sum(p.numel() for p in module.parameters()) == config.params(D)
    names = set(config.param_shapes(D))
    norm = config.qk_norm
    assert ({"q_norm.weight", "k_norm.weight"} <= names) == (norm is not None and norm.type == "rmsnorm")
    assert ("sinks" in names) == config.sinks


def test_visible_pairs_under_chunks_count_the_kernels_mask():
    from yamlformer.kernels.attention import _visible

    for seq_q, seq_k in ((1, 1), (1, 9), (5, 5), (7, 19), (19, 19), (3, 30)):
        for causal in (True, False):
            for window in (None, 1, 2, 5, 40):
                for chunk in (1, 2, 3, 4, 7, 64):
                    mask = Mask(causal=causal, sliding_window=window, chunk_size=chunk)
                    keep, _ = _visible(seq_q, seq_k, mask, "cpu")
                    counted = visible_pairs(seq_q, seq_k, causal, window, chunk)
                    assert counted == int(keep.sum()), (seq_q, seq_k, causal, window, chunk)
    config = _config({"n_heads": 4, "chunk_size": 8192})
    assert config.visible_pairs(1 << 20, 1 << 20, True) == 128 * 8192 * 8193 // 2  # closed form, instantly
    assert config.masked(causal=False)


def _saved_bytes(module, x, inputs) -> int:
    """Bytes autograd keeps for backward of one forward (parameters left out, storages once)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x, inputs)
    return sum(saved.values())


@pytest.mark.parametrize("backend", ["eager", "triton"])  # triton: FlashAttention's output and log-sum-exp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_bytes_are_what_autograd_keeps(name, causal, dtype, backend):
    config, module = _block(CASES[name], causal=causal, backend=backend)
    module = module.to(dtype).train()
    rope = RopeConfig()
    x = torch.randn(B, S, D, dtype=dtype, requires_grad=True)
    inputs = AttentionInputs(0, S, positions=torch.arange(S).expand(B, S), position=Rope(rope))
    act = 2 if dtype == torch.bfloat16 else 4
    want = config.saved_bytes(D, B, S, S, act, fused=backend == "triton", masked=config.masked(causal))
    want += rope.saved_bytes_per_layer(B, S, config.rotary_head_dim(D), act)
    assert _saved_bytes(module, x, inputs) == want


def test_a_nope_layer_rotates_nothing_and_saves_no_tables():
    config = _config({"n_heads": 4, "rope": False})
    assert config.rotary_head_dim(D) == 0
    assert RopeConfig().saved_bytes_per_layer(B, S, config.rotary_head_dim(D), 4) == 0


# -- rules ---------------------------------------------------------------------------------------


def _problems(data: dict) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as err:
        load_spec(data)
    return [(p.path, p.message) for p in err.value.problems]


def test_bad_values_are_located():
    nope = _spec({"n_heads": 4}, [{"layers": [1], "attention": {"rope": False}}], position={"type": "learned"})
    [(path, message)] = _problems(nope)
    assert path == "decoder.overrides.0.attention.rope" and "rotary position" in message
    theta = _spec({"n_heads": 4, "rope_theta": 100.0}, position={"type": "alibi"})
    [(path, message)] = _problems(theta)
    assert path == "decoder.attention.rope_theta" and "alibi" in message
    both = _spec({"n_heads": 4, "rope": False, "rope_theta": 100.0})
    [(path, message)] = _problems(both)
    assert path == "decoder.attention.rope_theta" and "rope: false" in message
    l2 = _spec({"n_heads": 4, "qk_norm": {"type": "l2", "unit_offset": True}})
    [(path, message)] = _problems(l2)
    assert path == "decoder.attention.qk_norm.unit_offset" and "no weight" in message
    for field, value in (("chunk_size", 0), ("qk_norm", {"over": "tokens"}), ("temperature_tuning", {"scale": 0.1})):
        [(path, _)] = _problems(_spec({"n_heads": 4, field: value}))
        assert path.startswith(f"decoder.attention.{field}")


def test_a_cross_attention_takes_none_of_the_positional_options():
    config = _config({**CASES["everything"], "rope": False, "rope_theta": None, "n_kv_heads": 2})
    cross = config.for_cross_attention()
    assert (cross.chunk_size, cross.sliding_window, cross.rope, cross.temperature_tuning) == (None, None, True, None)
    assert cross.sinks and cross.qk_norm == config.qk_norm  # these mean the same over an encoder's output
    assert not cross.problems(D, cross=True)
    located = {loc[0] for loc, _ in config.problems(D, cross=True)}
    assert located == {"sliding_window", "chunk_size", "rope", "temperature_tuning"}
    module = build_block(cross, DIMS, cross=True, backend="eager")
    memory = torch.randn(B, 5, D)
    assert module(torch.randn(B, S, D), AttentionInputs(0, S), memory=memory).shape == (B, S, D)


def test_a_norm_over_the_projection_refuses_tensor_parallelism_at_its_field():
    spec = load_spec(_spec({"n_heads": 4, "qk_norm": {"over": "projection"}}))
    [(loc, message)] = tensor_parallel_problems(spec, 2)
    assert loc == ("decoder", "attention", "qk_norm", "over") and "over: head" in message
    assert not tensor_parallel_problems(load_spec(_spec({"n_heads": 4, "qk_norm": {}, "sinks": True})), 2)


# -- slow: tensor parallelism on two CPU processes (gloo) -----------------------------------------

TP_SPEC = _spec(
    {"n_heads": 4, "n_kv_heads": 2, "qk_norm": {"unit_offset": True}, "sinks": True, "chunk_size": 4},
    [{"layers": [1], "attention": {"rope": False, "temperature_tuning": {"floor_scale": 2, "scale": 0.3}}}],
)


def _tp_model():
    torch.manual_seed(0)
    model = build_model(load_spec(TP_SPEC), attention_backend="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    return model


def _tp_loss(model):
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())


def _tp_worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from yamlformer.recipes.parallel.tensor import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = _tp_model()
    apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    loss = _tp_loss(model)
    loss.backward()
    grads = {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
    }
    torch.save({"loss": loss.detach(), "grads": grads}, os.path.join(out, f"{rank}.pt"))
    end_process_group()


@pytest.mark.slow
def test_tensor_parallel_splits_the_heads_and_sums_the_shared_gradients(tmp_path):
    """Each rank computes two heads with its own heads' sinks; the per-head norm weights and the
    sinks get every head's gradient on both ranks, as one process gives them."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    model = _tp_model()
    loss = _tp_loss(model)
    loss.backward()
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-6, msg=f"rank {rank}: {name}")
    assert math.isfinite(loss.item())
