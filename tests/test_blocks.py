"""Every registered block: built through ``build_block``, output shapes, forward and backward,
a fixed-seed golden value, and an independent reference (plain PyTorch from the paper, or
Hugging Face ``transformers`` where it defines the convention: RoPE scalings, ALiBi slopes,
T5 buckets, Mixtral's load-balancing loss)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from yamlformer.blocks import registry
from yamlformer.blocks.attention import AttentionInputs
from yamlformer.blocks.build import Dims, build_block
from yamlformer.blocks.init import init_weights
from yamlformer.blocks.layers import TransformerLayer

torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a shared CPU

D, B, S, V = 32, 2, 7, 50
DIMS = Dims(d_model=D, vocab_size=V, max_seq_len=16, n_heads=4, rotary_head_dim=8)


def _cfg(kind: str, data: dict):
    name = data.get("type") or {"attention": "multi_head", "ffn": "mlp", "norm": "layernorm"}.get(kind)
    return registry.config_class(kind, name).model_validate(data)


def _built(kind: str, data: dict, seed: int = 0, **extra):
    torch.manual_seed(seed)
    module = build_block(_cfg(kind, data), DIMS, **extra)
    return init_weights(module)


def _x(seed: int = 1, shape=(B, S, D)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _examples():
    for kind in ("attention", "position", "ffn", "norm", "head"):
        for name, cls in registry.configs(kind).items():
            for i, example in enumerate(getattr(cls, "examples", [{}])):
                yield pytest.param(kind, {"type": name, **example}, id=f"{kind}-{name}-{i}")


def _head_context():
    """What a model gives its head on a forward without a cache (``yamlformer.blocks.heads.HeadContext``)."""
    from yamlformer.blocks.embeddings import Embeddings
    from yamlformer.blocks.heads import HeadContext

    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    embedding = init_weights(Embeddings(V, D))
    return HeadContext(ids, embedding, AttentionInputs(0, S, positions=torch.arange(S).expand(B, S)))


def _forward(kind: str, module, config, x: torch.Tensor):
    """Run a block on inputs of its kind; return (output, expected shape)."""
    positions = torch.arange(S).expand(B, S)
    if kind in ("attention", "ffn", "norm"):
        out = module(x, AttentionInputs(0, S)) if kind == "attention" else module(x)
        return out, (B, S, D)
    if kind == "head":
        shape = (B, S, D) if config.type == "none" else (B, S, V) if type(config).projects_to_vocab else None
        out = module(x, None, _head_context())  # its auxiliary losses join the output: gradients reach them
        losses = sum(out.losses.values(), torch.zeros(()))
        return out.logits + losses, shape or (B, getattr(config, "n_classes", 0))
    if config.acts_on == "embedding":
        return module(positions) + x, (B, S, D)
    # a position acting in attention, through its hooks (each a no-op unless the block has it)
    q, k = module.rotate(x.view(B, S, 4, 8).transpose(1, 2), x.view(B, S, 4, 8).transpose(1, 2), positions)
    scores = q @ k.transpose(-1, -2)  # (B, 4, S, S)
    slopes = module.alibi_slopes(4)
    if slopes is not None:
        distance = (torch.arange(S)[:, None] - torch.arange(S)[None, :]).abs()  # (S, S)
        scores = scores - slopes[:, None, None] * distance
    bias = module.score_bias(torch.arange(S), torch.arange(S), 4)
    return (scores if bias is None else scores + bias), (B, 4, S, S)


@pytest.mark.parametrize("kind, data", list(_examples()))
def test_every_registered_block_builds_runs_and_backpropagates(kind, data):
    config = _cfg(kind, data)
    module = _built(kind, data, causal=True)
    x = _x().requires_grad_()
    out, shape = _forward(kind, module, config, x)
    assert tuple(out.shape) == shape
    out.float().pow(2).sum().backward()
    assert x.grad is not None or kind == "position"
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # parameters and FLOPs are what the config counts
    if kind in ("attention", "ffn", "norm"):
        assert sum(p.numel() for p in module.parameters()) == config.params(D)
    if kind in ("attention", "ffn"):
        with FlopCounterMode(display=False) as counter:
            _forward(kind, build_block(config, DIMS, causal=True, backend="eager"), config, x[:1])
        expected = config.flops(D, S, S) if kind == "attention" else config.flops(D, S)
        assert counter.get_total_flops() == expected


# ---- golden values: fixed seeds, computed once with this code and pasted ----

GOLDEN = {
    "attention": [0.000241559159, 0.00200105552, -0.00327415904, 0.00207844726],
    "glu": [-0.000467583537, 0.00100439053, -1.87890109e-05, 0.000542124093],
    "layernorm": [-1.35862577, -0.470467567, 1.20084763, -1.69644558],
    "lm": [-0.101803854, 0.225915626, 0.387985438, -0.289046764],
    "mlp": [-0.0173212662, 0.00113444065, -0.0115424432, -0.0274816994],
    "moe": [0.00014490787, -0.000547397067, 0.000562432397, -0.000133373396],  # stacked experts (own init draws)
    "relative_bias": [-0.0429622792, -0.0279557034, -0.0176483467, 0.00811222102],
    "rmsnorm": [-1.37303233, -0.0698030218, 1.46950293, -1.34391606],
    "rope": [1.82478833, -0.428590089, -0.701566637, -1.86127412],
    "sinusoidal": [0.141120002, 0.999755025, 0.277480543, 0.999998748],
}


def _golden_outputs() -> dict[str, torch.Tensor]:
    x = _x()
    pos = torch.arange(3, 3 + S).expand(B, S)
    attn = _built(
        "attention",
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 12, "qkv_bias": True, "softcap": 5.0},
        causal=True,
        backend="eager",
    )
    rope = _built(
        "position",
        {"type": "rope", "rotary_fraction": 0.5, "scaling": {"type": "yarn", "factor": 4.0, "original_max_seq_len": 8}},
    )
    q = x.view(B, S, 4, 8).transpose(1, 2)
    rel = _built("position", {"type": "relative_bias", "num_buckets": 8, "max_distance": 16}, causal=False)
    return {
        "attention": attn(x, AttentionInputs(0, S)),
        "mlp": _built("ffn", {"type": "mlp", "activation": "gelu_tanh", "bias": True})(x),
        "glu": _built("ffn", {"type": "glu", "activation": "silu", "hidden_dim": 40})(x),
        "moe": _built("ffn", {"type": "moe", "n_experts": 4, "top_k": 2, "expert": {"type": "glu", "hidden_dim": 24}})(
            x
        ),
        "layernorm": _built("norm", {"type": "layernorm"})(x * 3 + 1),
        "rmsnorm": _built("norm", {"type": "rmsnorm", "unit_offset": True})(x * 3 + 1),
        "rope": rope(q, q, pos)[0],
        "sinusoidal": _built("position", {"type": "sinusoidal"})(pos),
        "relative_bias": rel(torch.arange(S), torch.arange(S), 4),
        "lm": _built("head", {"type": "lm", "bias": True, "softcap": 0.5, "output_scale": 2.0})(x).logits,
    }


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_values(name):
    out = _golden_outputs()[name].detach().flatten()
    picks = out[torch.linspace(0, out.numel() - 1, 4).long()]
    torch.testing.assert_close(picks, torch.tensor(GOLDEN[name]), rtol=1e-5, atol=1e-7)


# ---- independent references ----


def _reference_attention(q, k, v, *, causal, window=None, scale=None, softcap=None, bias=None, slopes=None):
    """Attention from the paper, spelled out: scores, soft-cap, bias, ALiBi, masks, softmax, mix."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    sq, sk = q.shape[2], k.shape[2]
    i = torch.arange(sk - sq, sk)[:, None]
    j = torch.arange(sk)[None, :]
    if bias is not None:
        scores = scores + bias
    if slopes is not None:
        scores = scores - slopes[:, None, None] * (i - j)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= i - j < window
    scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize(
    "data, causal",
    [
        ({"n_heads": 4, "n_kv_heads": 2, "head_dim": 12, "qkv_bias": True, "out_bias": True}, True),
        ({"n_heads": 4, "n_kv_heads": 1, "sliding_window": 3, "softcap": 2.0, "scale": 0.5}, True),
        ({"n_heads": 2, "head_dim": 24, "sliding_window": 4}, False),
    ],
)
def test_attention_matches_a_plain_reference(data, causal):
    config = _cfg("attention", data)
    attn = _built("attention", data, causal=causal, backend="eager")
    x = _x()
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0
    h, hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_proj(x).view(B, S, h, hd).transpose(1, 2)
    k = attn.k_proj(x).view(B, S, hkv, hd).transpose(1, 2)
    v = attn.v_proj(x).view(B, S, hkv, hd).transpose(1, 2)
    pad = torch.zeros(B, 1, 1, S).masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    ref = _reference_attention(
        q, k, v, causal=causal, window=config.sliding_window, scale=config.scale, softcap=config.softcap, bias=pad
    )
    ref = attn.out_proj(ref.transpose(1, 2).reshape(B, S, h * hd))
    out = attn(x, AttentionInputs(0, S, key_mask=mask))
    live = ~(torch.isnan(ref).any(-1))  # a padded query that sees no key is 0 in ours, NaN in the reference
    torch.testing.assert_close(out[live], ref[live], rtol=1e-5, atol=1e-6)


def test_cross_attention_and_alibi_in_attention_match_the_reference():
    from yamlformer.blocks.positions import Alibi, alibi_slopes

    data = {"n_heads": 4, "n_kv_heads": 2}
    cross = _built("attention", data, cross=True, backend="eager")
    x, memory = _x(), _x(2, (B, 5, D))
    mask = torch.ones(B, 5, dtype=torch.long)
    mask[1, 3:] = 0
    k, v = cross.project_memory(memory)
    q = cross.q_proj(x).view(B, S, 4, 8).transpose(1, 2)
    pad = torch.zeros(B, 1, 1, 5).masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    ref = cross.out_proj(_reference_attention(q, k, v, causal=False, bias=pad).transpose(1, 2).reshape(B, S, 32))
    torch.testing.assert_close(cross(x, AttentionInputs(0, S, key_mask=mask), memory=memory), ref, rtol=1e-5, atol=1e-6)

    attn = _built("attention", data, causal=True, backend="eager")
    alibi = Alibi(_cfg("position", {"type": "alibi"}))
    q = attn.q_proj(x).view(B, S, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(B, S, 2, 8).transpose(1, 2)
    v = attn.v_proj(x).view(B, S, 2, 8).transpose(1, 2)
    ref = _reference_attention(q, k, v, causal=True, slopes=alibi_slopes(4))
    ref = attn.out_proj(ref.transpose(1, 2).reshape(B, S, 32))
    torch.testing.assert_close(attn(x, AttentionInputs(0, S, position=alibi)), ref, rtol=1e-5, atol=1e-6)


def _hf():  # the Hugging Face parity checks skip when transformers is not installed
    return pytest.importorskip("transformers")


ROPE_CASES = [
    ({}, "default", None),
    ({"type": "linear", "factor": 4.0}, "linear", None),
    ({"type": "ntk", "factor": 2.0}, "dynamic", "ntk"),
    ({"type": "yarn", "factor": 4.0, "original_max_seq_len": 8}, "yarn", None),
    (
        {
            "type": "yarn",
            "factor": 8.0,
            "original_max_seq_len": 16,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.3,
        },
        "yarn",
        None,
    ),
    ({"type": "llama3", "factor": 8.0, "original_max_seq_len": 8}, "llama3", None),
    # DeepSeek's: cos/sin by the ratio of the two mscales (1 when they are equal, as V2/V3 ship)
    ({"type": "yarn", "factor": 40.0, "original_max_seq_len": 4, "mscale": 1.0, "mscale_all_dim": 0.707}, "yarn", None),
    (
        {"type": "yarn", "factor": 40.0, "original_max_seq_len": 4, "mscale": 0.707, "mscale_all_dim": 0.707},
        "yarn",
        None,
    ),
]


@pytest.mark.parametrize("scaling, hf_type, note", ROPE_CASES, ids=[c[1] + str(i) for i, c in enumerate(ROPE_CASES)])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rope_frequencies_match_hugging_face(scaling, hf_type, note, rotary_fraction):
    _hf()
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from yamlformer.blocks.positions import rope_frequencies

    head_dim, max_pos = 32, 8
    config = _cfg("position", {"type": "rope", "rotary_fraction": rotary_fraction, "scaling": scaling or None})
    params = {"rope_type": hf_type, "rope_theta": 10000.0, "partial_rotary_factor": rotary_fraction}
    if config.scaling is not None:  # every knob, defaults included, under HF's names
        renames = {"original_max_seq_len": "original_max_position_embeddings"}
        knobs = config.scaling.model_dump(exclude={"type"}, exclude_none=True)
        params.update({renames.get(k, k): v for k, v in knobs.items()})
    hf_config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )
    if hf_type == "default":
        dim = int(head_dim * rotary_fraction)
        expected, factor = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim)), 1.0
    elif note == "ntk":
        # static NTK-aware = HF's dynamic formula where factor * len / max - (factor - 1) == factor
        f = scaling["factor"]
        expected, factor = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=max_pos * (2 * f - 1) / f)
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[hf_type](hf_config, "cpu")
    ours, our_factor = rope_frequencies(config, head_dim)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(factor)


@pytest.mark.parametrize("mscale_all_dim", [None, 0.707, 1.0])
def test_yarn_mscale_all_dim_scales_every_score_as_deepseek_does(mscale_all_dim):
    """DeepSeek-V2/V3 (and transformers' ``yarn_apply_mscale``): softmax scale times
    ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2``; an attention honours the position's
    ``score_scale`` on top of its own scale."""
    from yamlformer.blocks.positions import Rope

    scaling = {
        "type": "yarn",
        "factor": 40.0,
        "original_max_seq_len": 4,
        "mscale_all_dim": mscale_all_dim,
        "mscale": mscale_all_dim,
    }
    rope = Rope(_cfg("position", {"type": "rope", "scaling": scaling}))
    expected = 1.0 if mscale_all_dim is None else (0.1 * mscale_all_dim * math.log(40.0) + 1.0) ** 2
    assert rope.score_scale() == pytest.approx(expected)
    x = _x()
    positions = torch.arange(S).expand(B, S)
    scaled = _built("attention", {"n_heads": 4}, causal=True, backend="eager")
    explicit = _built("attention", {"n_heads": 4, "scale": 8**-0.5 * expected}, causal=True, backend="eager")
    plain = {
        "type": "yarn",
        "factor": 40.0,
        "original_max_seq_len": 4,  # the same cos and sin, no score scale
        "attention_factor": 1.0 if mscale_all_dim else None,
    }
    plain_rope = Rope(_cfg("position", {"type": "rope", "scaling": plain}))
    assert plain_rope.score_scale() == 1.0
    torch.testing.assert_close(
        scaled(x, AttentionInputs(0, S, positions=positions, position=rope)),
        explicit(x, AttentionInputs(0, S, positions=positions, position=plain_rope)),
    )


def test_rope_rotation_matches_complex_multiplication():
    """GPT-NeoX layout: dimension i pairs with i + rotary_dim/2, rotated by position * inv_freq_i
    (as multiplying by e^{i theta}); dimensions past rotary_dim pass through; YaRN scales by its factor."""
    from yamlformer.blocks.positions import rope_frequencies

    config = _cfg(
        "position",
        {"type": "rope", "rotary_fraction": 0.5, "scaling": {"type": "yarn", "factor": 4.0, "original_max_seq_len": 8}},
    )
    rope = build_block(config, DIMS)
    q = _x(3, (B, 4, S, 16))
    positions = torch.arange(5, 5 + S).expand(B, S)
    out, _ = rope(q, q, positions)
    inv_freq, factor = rope_frequencies(config, 16)
    half = 4
    z = torch.complex(q[..., :half], q[..., half:8])  # (batch, heads, seq, 4)
    angle = positions[:, None, :, None].float() * inv_freq
    rotated = z * torch.polar(torch.full_like(angle, factor), angle)
    ref = torch.cat((rotated.real, rotated.imag, q[..., 8:]), dim=-1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # scores depend only on the distance between positions
    q1, k1 = rope(q, q, positions)
    q2, k2 = rope(q, q, positions + 11)
    torch.testing.assert_close(q1 @ k1.transpose(-1, -2), q2 @ k2.transpose(-1, -2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 32])
def test_alibi_slopes_match_the_paper_and_hugging_face(n_heads):
    _hf()
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from yamlformer.blocks.positions import alibi_slopes

    hf = build_alibi_tensor(torch.ones(1, 3), n_heads, torch.float32)  # (heads, 1, 3): slope * position
    torch.testing.assert_close(alibi_slopes(n_heads), hf[:, 0, 1], rtol=1e-6, atol=0)
    if n_heads == 8:  # the paper: 1/2, 1/4, ..., 1/256
        torch.testing.assert_close(alibi_slopes(8), 0.5 ** torch.arange(1, 9).float())


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 16), (16, 32)])
def test_t5_buckets_match_hugging_face(bidirectional, num_buckets, max_distance):
    _hf()
    from transformers.models.t5.modeling_t5 import T5Attention

    from yamlformer.blocks.positions import relative_position_bucket

    relative = torch.arange(-300, 300)[None, :] + torch.arange(0, 3)[:, None]
    ours = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    theirs = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("causal", [False, True])
def test_relative_bias_matches_hugging_face_compute_bias(causal):
    _hf()
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = _built("position", {"type": "relative_bias", "num_buckets": 8, "max_distance": 16}, causal=causal)
    hf_config = T5Config(
        d_model=32,
        d_kv=8,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        is_decoder=causal,
    )
    hf = T5Attention(hf_config, has_relative_attention_bias=True)
    with torch.no_grad():
        hf.relative_attention_bias.weight.copy_(rel.weight)
        theirs = hf.compute_bias(3, 9, past_seen_tokens=6)  # decoding: 3 queries after 6 cached tokens
        ours = rel(torch.arange(6, 9), torch.arange(9), 4)
    torch.testing.assert_close(ours, theirs)


def test_moe_dispatch_equals_dense_reference_and_counts_only_routed_rows():
    data = {"type": "moe", "n_experts": 4, "top_k": 2, "expert": {"type": "glu", "hidden_dim": 24}}
    config = _cfg("ffn", data)
    moe = _built("ffn", data)
    x = _x()
    out = moe(x)
    flat = x.reshape(-1, D)
    probs = moe.router(flat).softmax(-1)
    top, idx = probs.topk(2, dim=-1)
    gates = torch.zeros_like(probs).scatter(1, idx, top / top.sum(-1, keepdim=True))  # Mixtral
    w = {p: getattr(moe.experts, f"{p}_proj").weight for p in ("gate", "up", "down")}  # stacked (4, out, in)

    def expert(e, rows):  # a SwiGLU of expert e's slices, as a separate GLU computes it
        return (F.silu(rows @ w["gate"][e].T) * (rows @ w["up"][e].T)) @ w["down"][e].T

    dense = sum(gates[:, e : e + 1] * expert(e, flat) for e in range(4))
    torch.testing.assert_close(out.reshape(-1, D), dense, rtol=1e-5, atol=1e-6)
    with FlopCounterMode(display=False) as counter:
        moe(x)
    assert counter.get_total_flops() == config.flops(D, B * S)  # top_k * tokens rows, not all experts


def test_moe_aux_loss_matches_mixtral():
    _hf()
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    moe = _built("ffn", {"type": "moe", "n_experts": 4, "top_k": 2, "expert": {"type": "mlp", "hidden_dim": 16}})
    x = _x()
    moe(x)
    logits = moe.router(x.reshape(-1, D))
    expected = load_balancing_loss_func((logits,), num_experts=4, top_k=2)
    torch.testing.assert_close(moe.aux_loss, expected, rtol=1e-5, atol=1e-6)


def test_norms_match_torch():
    x = _x() * 3 + 1
    ln = _built("norm", {"type": "layernorm", "eps": 1e-6})
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    ref = torch.nn.functional.layer_norm(x, (D,), ln.weight, ln.bias, 1e-6)
    torch.testing.assert_close(ln(x), ref)
    no_bias = _built("norm", {"type": "layernorm", "bias": False})
    assert no_bias.bias is None and sum(p.numel() for p in no_bias.parameters()) == D
    rms = _built("norm", {"type": "rmsnorm", "eps": 1e-6})
    with torch.no_grad():
        rms.weight.normal_()
    torch.testing.assert_close(rms(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight)
    gemma = _built("norm", {"type": "rmsnorm", "eps": 1e-6, "unit_offset": True})
    with torch.no_grad():
        gemma.weight.copy_(rms.weight - 1)
    torch.testing.assert_close(gemma(x), rms(x))


def test_sinusoidal_and_learned_positions():
    pos = torch.arange(S).expand(B, S)
    table = _built("position", {"type": "sinusoidal"})(pos)
    p, i = 5, 3
    assert table[0, p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / D)), abs=1e-6)
    assert table[0, p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / D)), abs=1e-6)
    split = _built("position", {"type": "sinusoidal", "layout": "split"})(pos)
    assert split[0, p, i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / D)), abs=1e-6)
    assert split[0, p, D // 2 + i].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / D)), abs=1e-6)
    learned = _built("position", {"type": "learned"})
    torch.testing.assert_close(learned(pos)[1], learned.weight[:S])
    with pytest.raises(ValueError, match="beyond the learned table"):
        learned(torch.tensor([[16]]))


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
def test_layer_placements_compose_as_documented(placement):
    norm = {"type": "rmsnorm", "placement": placement}
    attn = _built("attention", {"n_heads": 4}, causal=True)
    ffn = _built("ffn", {"type": "mlp"})
    names = ["attention_norm", "ffn_norm"] + (
        ["attention_post_norm", "ffn_post_norm"] if placement == "sandwich" else []
    )
    norms = {name: _built("norm", norm, seed=i) for i, name in enumerate(names)}
    for n in norms.values():
        with torch.no_grad():
            n.weight.normal_()
    layer = TransformerLayer(attn, ffn, norms, placement=placement)
    x, inputs = _x(), AttentionInputs(0, S)
    a = lambda h: attn(h, inputs)
    if placement == "pre":
        h = x + a(norms["attention_norm"](x))
        ref = h + ffn(norms["ffn_norm"](h))
    elif placement == "post":
        h = norms["attention_norm"](x + a(x))
        ref = norms["ffn_norm"](h + ffn(h))
    else:
        h = x + norms["attention_post_norm"](a(norms["attention_norm"](x)))
        ref = h + norms["ffn_post_norm"](ffn(norms["ffn_norm"](h)))
    torch.testing.assert_close(layer(x, inputs), ref)
    with pytest.raises(ValueError, match="needs norms"):
        TransformerLayer(attn, ffn, {"attention_norm": norms["attention_norm"]}, placement=placement)


def test_heads_match_their_definitions():
    from torch import nn

    x = _x()
    table = nn.Embedding(V, D)
    lm = _built("head", {"type": "lm", "bias": True, "softcap": 3.0, "output_scale": 0.5}, tied_embedding=table)
    assert lm.proj.weight is table.weight
    with torch.no_grad():
        lm.proj.bias.normal_()
    out = lm(x)
    assert out.losses == {}
    torch.testing.assert_close(out.logits, 3.0 * torch.tanh(F.linear(x * 0.5, table.weight, lm.proj.bias) / 3.0))
    mlm = _built("head", {"type": "mlm"})
    ref = mlm.proj(F.layer_norm(F.gelu(mlm.dense(x)), (D,), eps=1e-12))
    torch.testing.assert_close(mlm(x).logits, ref)
    cls = _built("head", {"type": "classification", "n_classes": 3, "pooling": "mean", "pooler": True})
    mask = torch.ones(B, S)
    mask[1, 4:] = 0
    pooled = torch.stack([x[0].mean(0), x[1, :4].mean(0)])
    torch.testing.assert_close(cls(x, mask).logits, cls.classifier(torch.tanh(cls.pooler(pooled))))
    first = _built("head", {"type": "classification"})
    torch.testing.assert_close(first(x).logits, first.classifier(x[:, 0]))
    assert _built("head", {"type": "none"})(x).logits is x


def test_embeddings_scale_segments_norm():
    from yamlformer.blocks.embeddings import Embeddings

    norm = _built("norm", {"type": "layernorm"})
    emb = init_weights(Embeddings(V, D, scale="sqrt_d", segments=2, norm=norm))
    ids = torch.randint(0, V, (B, S))
    types = torch.randint(0, 2, (B, S))
    pos = torch.randn(B, S, D)
    ref = norm(emb.tokens.weight[ids] * math.sqrt(D) + pos + emb.segments.weight[types])
    torch.testing.assert_close(emb(ids, types, pos), ref)
    with pytest.raises(ValueError, match="scale"):
        Embeddings(V, D, scale="sqrt")


def test_build_block_reports_a_missing_dimension():
    config = _cfg("position", {"type": "relative_bias"})
    with pytest.raises(TypeError, match="n_heads"):
        build_block(config, Dims(d_model=D, vocab_size=V, max_seq_len=16))
    with pytest.raises(TypeError, match="causal"):
        build_block(config, DIMS)
