"""DeepSeek-V2/V3 blocks beyond what the registry-wide tests check for every block: the specs'
counts against transformers built on meta, the latent cache (its bytes, decoding that never
expands it, the Triton route), DeepSeekMoE's routing rules and its auxiliary-loss-free bias,
the spec rules, and the zoo's tiny specs exported to transformers. (Counts, FLOPs, saved bytes,
cached == recomputed decoding and describe == generate cache bytes come from the tests that
walk the registry and ``specs/``; import parity is in ``tests/test_hf.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sharded_helpers import end_process_group

from yamlformer.blocks import registry
from yamlformer.blocks.build import Dims, build_block
from yamlformer.blocks.cache import KVCache
from yamlformer.blocks.init import init_weights
from yamlformer.builder import build_model, estimate, load_spec
from yamlformer.builder.spec.loader import SpecError
from yamlformer.builder.spec.schema import SpecRuleError, spec_model

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"


def _moe(**fields):
    data = {"type": "deepseek_moe", "n_experts": 8, "top_k": 2, "expert": {"type": "glu", "hidden_dim": 16}, **fields}
    config = registry.config_class("ffn", "deepseek_moe").model_validate(data)
    torch.manual_seed(0)
    return config, init_weights(build_block(config, Dims(d_model=32, vocab_size=50, max_seq_len=16)))


# --- the specs ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, family", [("deepseek-v2-lite", "deepseek_v2"), ("deepseek-v3", "deepseek_v3")])
def test_full_specs_count_what_transformers_builds_on_meta(name, family):
    """The spec's count equals transformers' model, built on meta from the config export-hf
    writes for it: the main model (DeepseekV3ForCausalLM) is the spec with an lm head, and V3's
    multi-token-prediction module is transformers' MtpModel less the embedding and head it shares."""
    transformers = pytest.importorskip("transformers")
    from yamlformer.builder.hf import FAMILIES

    spec = load_spec(SPECS / f"{name}.yaml")
    config = FAMILIES[family].to_config(spec)
    hf_config = transformers.AutoConfig.for_model(family, **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    main = sum(p.numel() for p in model.parameters())
    assert main == estimate(load_spec(SPECS / f"{name}.yaml", overrides={"head": {"type": "lm"}})).params.total
    depth = config.get("num_nextn_predict_layers", 0)
    assert depth == (1 if name == "deepseek-v3" else 0)
    if depth:
        from transformers.modeling_layers import MtpModel

        with torch.device("meta"):
            mtp = MtpModel(model, depth)
        shared = {id(p) for p in model.parameters()}
        main += sum(p.numel() for p in mtp.parameters() if id(p) not in shared)
    assert main == estimate(spec).params.total


def test_latent_cache_bytes_are_the_latent_and_the_rotary_key():
    """(kv_lora_rank + qk_rope_head_dim) x layers x dtype per token, whatever the head count."""
    for name, layers in (("deepseek-v2-lite", 27), ("deepseek-v3", 61)):
        spec = load_spec(SPECS / f"{name}.yaml")
        per_token = estimate(spec, seq_len=1000, batch=3, dtype="bf16").memory.kv_cache / 3000
        assert per_token == (512 + 64) * layers * 2


# --- multi-head latent attention ---------------------------------------------------------


def test_cached_decoding_never_expands_the_latent(monkeypatch):
    """With a cache, kv_b_proj is absorbed (its weight multiplies q and the output): the module is
    never called, and the cache holds one (kv_lora_rank + rope)-wide vector per token."""
    spec = load_spec(SPECS / "tiny" / "deepseek-v3.yaml")
    torch.manual_seed(0)
    model = build_model(spec).eval()
    ids = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
    calls = []
    for layer in model.decoder.layers:
        layer.attention.kv_b_proj.register_forward_hook(lambda *a: calls.append(1))
    cache = KVCache.for_stack(model.decoder, 2, 9, torch.float32, "cpu")
    with torch.no_grad():
        steps = [model(ids[:, :4], cache=cache)] + [model(ids[:, i : i + 1], cache=cache) for i in range(4, 9)]
    assert not calls
    attention = spec.decoder.attention
    assert [tuple(t.shape) for t in cache.layers[0]["attention"].tensors] == [
        (2, 1, 9, attention.kv_lora_rank + attention.qk_rope_head_dim)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_lora_rank", [16, 256])
def test_triton_backend_runs_latent_attention(kv_lora_rank):
    """Triton (the CPU interpreter here) computes the expanded path with 24-wide scores and
    16-wide values; the absorbed heads go to Triton while narrow and to SDPA past 256 wide."""
    data = {
        "name": "t",
        "architecture": "decoder-only",
        "vocab_size": 64,
        "d_model": 32,
        "max_seq_len": 32,
        "position": {"type": "rope"},
        "decoder": {
            "n_layers": 1,
            "attention": {
                "type": "mla",
                "n_heads": 2,
                "kv_lora_rank": kv_lora_rank,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
            },
            "ffn": {"type": "glu", "hidden_dim": 32},
            "norm": {"type": "rmsnorm"},
        },
    }
    spec = spec_model().model_validate(data)
    torch.manual_seed(0)
    eager = build_model(spec, attention_backend="eager").eval()
    triton = build_model(spec, attention_backend="triton").eval()
    triton.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(triton(ids), eager(ids), rtol=1e-4, atol=1e-5)
        cache = KVCache.for_stack(triton.decoder, 1, 7, torch.float32, "cpu")
        steps = [triton(ids[:, :5], cache=cache), triton(ids[:, 5:6], cache=cache), triton(ids[:, 6:], cache=cache)]
        torch.testing.assert_close(torch.cat(steps, dim=1), eager(ids), rtol=1e-4, atol=1e-5)


def test_latent_attention_takes_alibi_and_padding():
    """Positions that act on the scores (ALiBi) and a left-padded batch reach both paths."""
    data = {
        "name": "t",
        "architecture": "decoder-only",
        "vocab_size": 64,
        "d_model": 32,
        "max_seq_len": 32,
        "position": {"type": "alibi"},
        "decoder": {
            "n_layers": 2,
            "attention": {
                "type": "mla",
                "n_heads": 4,
                "kv_lora_rank": 16,
                "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 4,
                "v_head_dim": 8,
            },
            "ffn": {"type": "glu", "hidden_dim": 32},
            "norm": {"type": "rmsnorm"},
        },
    }
    model = build_model(spec_model().model_validate(data)).eval()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    padded = model.generate(ids, max_new_tokens=5, attention_mask=mask)
    alone = model.generate(ids[1:, 3:], max_new_tokens=5)
    assert torch.equal(padded[1, 8:], alone[0, 5:])
    assert torch.equal(padded, model.generate(ids, max_new_tokens=5, attention_mask=mask, use_cache=False))


# --- DeepSeekMoE -------------------------------------------------------------------------


def _reference_route(scores, bias, n_groups, topk_groups, group_score, top_k):
    """Group-limited top-k from the definition, one token at a time."""
    chosen = []
    for s in scores.tolist():
        biased = [x + b for x, b in zip(s, bias)] if bias is not None else s
        size = len(s) // n_groups
        groups = [biased[g * size : (g + 1) * size] for g in range(n_groups)]
        rank = [max(g) if group_score == "max" else sum(sorted(g)[-2:]) for g in groups]
        allowed = sorted(range(n_groups), key=lambda g: -rank[g])[:topk_groups]
        candidates = [e for g in allowed for e in range(g * size, (g + 1) * size)]
        chosen.append(sorted(sorted(candidates, key=lambda e: -biased[e])[:top_k]))
    return chosen


@pytest.mark.parametrize(
    "fields",
    [
        {"scoring": "softmax", "n_groups": 4, "topk_groups": 2},
        {
            "scoring": "sigmoid",
            "n_groups": 4,
            "topk_groups": 2,
            "group_score": "top2_sum",
            "expert_bias": True,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
        },
    ],
)
def test_routing_follows_the_definition(fields):
    config, moe = _moe(**fields)
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    flat = torch.randn(40, 32, generator=torch.Generator().manual_seed(5))
    scores, chosen, weights = moe.route(flat)
    bias = moe.expert_bias.tolist() if moe.expert_bias is not None else None
    expected = _reference_route(scores, bias, config.n_groups, config.topk_groups, config.group_score, config.top_k)
    assert [sorted(c) for c in chosen.tolist()] == expected
    picked = scores.gather(1, chosen)  # weights come from the unbiased scores
    if config.norm_topk_prob:
        picked = picked / picked.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, picked * config.routed_scaling_factor)


def test_expert_bias_moves_against_the_load_after_each_step():
    config, moe = _moe(scoring="sigmoid", expert_bias=True, bias_update_speed=0.01)
    x = torch.randn(3, 20, 32, generator=torch.Generator().manual_seed(6))
    moe.eval()(x)
    moe.after_optimizer_step()
    assert torch.equal(moe.expert_bias, torch.zeros(8)), "eval forwards are not counted"
    moe.train()
    _, chosen, _ = moe.route(x.reshape(-1, 32))
    load = torch.bincount(chosen.flatten(), minlength=8).float()
    moe(x)
    moe(x)  # two micro-batches before one optimizer step: loads add up
    moe.after_optimizer_step()
    torch.testing.assert_close(moe.expert_bias, 0.01 * torch.sign(load.mean() - load))
    assert "expert_bias" in moe.state_dict() and "load" not in moe.state_dict()
    before = moe.expert_bias.clone()
    moe.after_optimizer_step()  # nothing routed since: no move
    assert torch.equal(moe.expert_bias, before)


def test_expert_bias_sums_the_load_over_processes(tmp_path):
    """Under torch.distributed the load is all-reduced first, so every replica moves alike."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        _, moe = _moe(scoring="sigmoid", expert_bias=True)
        moe.train()(torch.randn(2, 10, 32))
        moe.after_optimizer_step()
        assert moe.expert_bias.abs().sum() > 0
    finally:
        end_process_group()


def test_balance_loss_is_one_when_balanced_and_training_moves_the_bias():
    """DeepSeek's expert-level loss N/K sum f_i P_i is 1 under uniform routing; a few optimizer
    steps on the tiny V3 spec train (loss falls) and move every MoE layer's bias."""
    config, moe = _moe(scoring="softmax")
    with torch.no_grad():
        moe.router.weight.zero_()  # equal scores: topk picks the first experts, P_i = 1/N
    moe(torch.randn(4, 32))
    f = torch.zeros(8)
    f[:2] = 8 / 2  # N/K * share of tokens, all on experts 0 and 1
    assert moe.aux_loss.item() == pytest.approx((f * (1 / 8)).sum().item())

    spec = load_spec(SPECS / "tiny" / "deepseek-v3.yaml")
    torch.manual_seed(0)
    model = build_model(spec).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, spec.vocab_size, (4, 16), generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(8):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        (loss + 1e-3 * model.aux_loss()).backward()
        opt.step()
        opt.zero_grad()
        model.after_optimizer_step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    moe_layers = [layer.ffn for layer in model.decoder.layers if hasattr(layer.ffn, "expert_bias")]
    assert moe_layers and all(m.expert_bias.abs().sum() > 0 for m in moe_layers)


# --- spec rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ffn, field, message",
    [
        ({"n_experts": 6, "n_groups": 4}, "n_groups", "multiple of n_groups"),
        ({"n_experts": 8, "top_k": 5, "n_groups": 4, "topk_groups": 2}, "top_k", "raise topk_groups"),
        ({"n_experts": 8, "topk_groups": 3, "n_groups": 2}, "topk_groups", "cannot exceed n_groups"),
        ({"n_experts": 4, "n_groups": 4, "topk_groups": 2, "group_score": "top2_sum"}, "group_score", "at least 2"),
    ],
)
def test_routing_rules_name_the_field(tmp_path, ffn, field, message):
    path = tmp_path / "bad.yaml"
    moe = {"type": "deepseek_moe", "top_k": 2, "expert": {"type": "glu", "hidden_dim": 16}, **ffn}
    import yaml

    path.write_text(yaml.safe_dump({"extends": str(SPECS / "tiny" / "deepseek-v3.yaml"), "decoder": {"ffn": moe}}))
    with pytest.raises(SpecError) as error:
        load_spec(path)
    assert [(p.path, message in p.message) for p in error.value.problems] == [(f"decoder.ffn.{field}", True)]


def test_latent_attention_in_an_encoder_decoder_needs_its_own_cross_attention():
    """An mla decoder's implied cross-attention is refused at validation (not at build); with a
    multi_head cross_attention the model builds, counts exactly and decodes from its cache."""
    data = {
        "name": "t",
        "architecture": "encoder-decoder",
        "vocab_size": 64,
        "d_model": 32,
        "max_seq_len": 32,
        "encoder": {"n_layers": 1, "attention": {"n_heads": 4}},
        "decoder": {
            "n_layers": 2,
            "attention": {
                "type": "mla",
                "n_heads": 4,
                "kv_lora_rank": 16,
                "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 4,
                "v_head_dim": 8,
            },
        },
    }
    with pytest.raises(SpecRuleError, match="decoder.attention: mla is a self-attention.*set cross_attention"):
        spec_model().model_validate(data)
    data["decoder"]["cross_attention"] = {"type": "multi_head", "n_heads": 2}
    spec = spec_model().model_validate(data)
    model = build_model(spec).eval()
    assert model.n_params() == estimate(spec).params.total
    src = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(8))
    cached = model.generate(src, max_new_tokens=6, decoder_start_token_id=0)
    assert torch.equal(cached, model.generate(src, max_new_tokens=6, decoder_start_token_id=0, use_cache=False))


def test_latent_attention_is_refused_as_a_cross_attention():
    data = load_spec(SPECS / "tiny" / "transformer.yaml").model_dump(exclude={"extends"})
    data["decoder"]["cross_attention"] = {
        "type": "mla",
        "n_heads": 4,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
    }
    with pytest.raises(SpecRuleError, match="decoder.cross_attention: mla is a self-attention"):
        spec_model().model_validate(data)


# --- the zoo's tiny specs written for transformers ---------------------------------------


@pytest.mark.parametrize("name, family", [("deepseek-v2", "deepseek_v2"), ("deepseek-v3", "deepseek_v3")])
def test_zoo_tiny_specs_export_with_the_same_logits(tmp_path, name, family):
    transformers = pytest.importorskip("transformers")
    from yamlformer.builder.hf import to_hf

    spec = load_spec(SPECS / "tiny" / f"{name}.yaml")
    torch.manual_seed(0)
    ours = build_model(spec).eval()
    with torch.no_grad():
        for p in ours.parameters():  # unit-scale weights: logits O(1)
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() >= 2 else 0.5 + torch.rand_like(p))
        for layer in ours.decoder.layers:
            if getattr(layer.ffn, "expert_bias", None) is not None:
                layer.ffn.expert_bias.normal_(0, 0.3)
    assert to_hf(spec, ours, tmp_path / "out").model_type == family
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, spec.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mine, hf_logits = ours(ids), theirs(ids).logits
    assert hf_logits.std() > 0.1
    assert (mine - hf_logits).abs().max().item() < 1e-4
