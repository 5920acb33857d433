"""Layer wiring and MoE options of issue 26, against Hugging Face's own modules.

* norm ``placement: post_sublayer`` (OLMo 2) and a stack's ``parallel_residual`` (``true``:
  GPT-NeoX, ``shared_norm``: GPT-J): our layer equals transformers' decoder layer running our
  attention and FFN inside it (its wiring, its norms loaded with ours);
* ``moe``'s ``router_bias``, ``expert_bias`` and ``clamp`` equal ``GptOssMLP``; ``deepseek_moe``
  with ``weight_on: input`` equals ``Llama4TextMoe``; ``moe`` (and ``deepseek_moe`` without
  renormalising) equal ``Qwen3MoeSparseMoeBlock``;
* counts: parameters, shapes and FLOPs equal the built model's, saved bytes what autograd keeps
  (each option against the same spec without it), active parameters by hand;
* cached and static decoding equal recomputation through whole tiny models;
* bad combinations are located errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from yamlformer.blocks.attention import AttentionInputs
from yamlformer.blocks.build import Dims, build_block
from yamlformer.blocks.cache import KVCache
from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.analysis.layout import layer_tensor_count
from yamlformer.builder.analysis.report import actual_params
from yamlformer.builder.assemble import build_model
from yamlformer.builder.spec.schema import spec_model

D, VOCAB, MAX_SEQ, B, T = 32, 50, 24, 2, 12
GPT_OSS = {
    "type": "moe",
    "n_experts": 4,
    "top_k": 2,
    "expert": {"type": "glu", "hidden_dim": 24},
    "router_bias": True,
    "expert_bias": True,
    "clamp": {"alpha": 1.702, "limit": 7.0},
}
LLAMA4 = {
    "type": "deepseek_moe",
    "n_experts": 4,
    "top_k": 1,
    "n_shared_experts": 1,
    "expert": {"type": "glu", "hidden_dim": 16},
    "scoring": "sigmoid",
    "weight_on": "input",
}
POST_SUBLAYER = {"type": "rmsnorm", "placement": "post_sublayer", "eps": 1e-6}


def _spec_data(architecture: str = "decoder-only", head: dict | None = None, **stack) -> dict:
    data = {
        "name": "layer-options",
        "architecture": architecture,
        "vocab_size": VOCAB,
        "d_model": D,
        "max_seq_len": MAX_SEQ,
        "head": head or {"type": "mlm" if architecture == "encoder-only" else "lm"},
    }
    names = {"decoder-only": ["decoder"], "encoder-only": ["encoder"], "encoder-decoder": ["encoder", "decoder"]}
    for name in names[architecture]:
        data[name] = {
            "n_layers": 2,
            "attention": {"n_heads": 4, "n_kv_heads": 2},
            "ffn": {"type": "glu", "hidden_dim": 40},
            "norm": {"type": "rmsnorm"},
            **stack,
        }
    return data


def _spec(architecture: str = "decoder-only", head: dict | None = None, **stack):
    return spec_model().model_validate(_spec_data(architecture, head, **stack))


# each case: (its spec's arguments, the same without the option: the saved-bytes baseline)
CASES = {
    "post_sublayer": ({"norm": POST_SUBLAYER}, {}),
    "parallel": ({"parallel_residual": True, "norm": {"type": "layernorm"}}, {"norm": {"type": "layernorm"}}),
    "parallel-shared_norm": ({"parallel_residual": "shared_norm"}, {}),
    "parallel-sandwich": (
        {"parallel_residual": True, "norm": {"type": "rmsnorm", "placement": "sandwich"}},
        {"norm": {"type": "rmsnorm", "placement": "sandwich"}},
    ),
    "parallel-post_sublayer": ({"parallel_residual": True, "norm": POST_SUBLAYER}, {"norm": POST_SUBLAYER}),
    "gpt_oss-moe": ({"ffn": GPT_OSS}, {"ffn": {**GPT_OSS, "router_bias": False, "clamp": None}}),
    "llama4-moe-interleaved": (
        {"ffn": LLAMA4, "overrides": [{"layers": "0::2", "ffn": {"type": "glu", "hidden_dim": 56}}]},
        {
            "ffn": {**LLAMA4, "weight_on": "output"},
            "overrides": [{"layers": "0::2", "ffn": {"type": "glu", "hidden_dim": 56}}],
        },
    ),
    "encoder-parallel": (
        {"architecture": "encoder-only", "parallel_residual": True},
        {"architecture": "encoder-only"},
    ),
    "encoder-decoder-shared_norm": (
        {"architecture": "encoder-decoder", "parallel_residual": "shared_norm"},
        {"architecture": "encoder-decoder"},
    ),
    "post_sublayer-gpt_oss-moe": ({"norm": POST_SUBLAYER, "ffn": GPT_OSS}, {"ffn": GPT_OSS}),
    "encoder-decoder-parallel-sandwich": (
        {
            "architecture": "encoder-decoder",
            "parallel_residual": True,
            "norm": {"type": "layernorm", "placement": "sandwich"},
        },
        {"architecture": "encoder-decoder", "norm": {"type": "layernorm", "placement": "sandwich"}},
    ),
    "mtp-parallel": (
        {"parallel_residual": True, "head": {"type": "mtp", "layer": {}}},
        {"head": {"type": "mtp", "layer": {}}},
    ),
}


def _case(name: str, which: int = 0):
    return _spec(**CASES[name][which])


def _forward(model, spec, ids):
    if spec.architecture == "encoder-decoder":
        return model(ids[:, :9], decoder_input_ids=ids)
    return model(ids)


# -- Hugging Face's layers, running our blocks ---------------------------------------------------


class _Attention(nn.Module):
    """Our attention under a Hugging Face layer's call: ``(output, weights)``."""

    def __init__(self, ours: nn.Module, inputs: AttentionInputs):
        super().__init__()
        self.ours, self.inputs = ours, inputs

    def forward(self, *args, **kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return self.ours(hidden, self.inputs), None


def _olmo2():
    from transformers import Olmo2Config
    from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer

    config = Olmo2Config(hidden_size=D, num_attention_heads=4, intermediate_size=40, rms_norm_eps=1e-6)
    stack = {"attention": {"n_heads": 4, "n_kv_heads": 2, "qk_norm": {"over": "projection"}}, "norm": POST_SUBLAYER}
    norms = {"post_attention_layernorm": "attention_norm", "post_feedforward_layernorm": "ffn_norm"}
    return Olmo2DecoderLayer(config, layer_idx=0), ("self_attn", "mlp"), norms, stack


def _gpt_neox():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer

    config = GPTNeoXConfig(hidden_size=D, num_attention_heads=4, intermediate_size=40, use_parallel_residual=True)
    ffn = {"type": "mlp", "activation": "gelu", "hidden_dim": 40, "bias": True}
    stack = {"norm": {"type": "layernorm", "eps": config.layer_norm_eps}, "ffn": ffn, "parallel_residual": True}
    norms = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    return GPTNeoXLayer(config, layer_idx=0), ("attention", "mlp"), norms, stack


def _gptj():
    from transformers import GPTJConfig
    from transformers.models.gptj.modeling_gptj import GPTJBlock

    config = GPTJConfig(n_embd=D, n_head=4, n_inner=40, rotary_dim=4)
    ffn = {"type": "mlp", "activation": "gelu_tanh", "hidden_dim": 40, "bias": True}
    norm = {"type": "layernorm", "eps": config.layer_norm_epsilon}
    return (
        GPTJBlock(config, layer_idx=0),
        ("attn", "mlp"),
        {"ln_1": "attention_norm"},
        {
            "norm": norm,
            "ffn": ffn,
            "parallel_residual": "shared_norm",
        },
    )


@pytest.mark.parametrize("family", [_olmo2, _gpt_neox, _gptj], ids=["olmo2", "gpt_neox", "gptj"])
def test_layer_wiring_matches_hugging_face(family):
    pytest.importorskip("transformers")
    hf, (attention_name, mlp_name), norms, stack = family()
    spec = _spec(**stack)
    torch.manual_seed(0)
    model = build_model(spec, attention_backend="eager").eval()
    ours = model.decoder.layers[0]
    x = torch.randn(B, T, D)
    inputs = AttentionInputs(0, T, positions=torch.arange(T).expand(B, T), position=model.decoder.position)
    with torch.no_grad():
        for hf_name, our_name in norms.items():
            norm = getattr(ours, our_name)
            for p in norm.parameters():
                p.normal_()
            getattr(hf, hf_name).load_state_dict(norm.state_dict())
        setattr(hf, attention_name, _Attention(ours.attention, inputs))
        setattr(hf, mlp_name, ours.ffn)
        expected = hf(hidden_states=x, attention_mask=None, position_ids=None, position_embeddings=None)
        expected = expected[0] if isinstance(expected, tuple) else expected
        torch.testing.assert_close(ours(x, inputs), expected)
    assert {name for name, _ in ours.named_children() if name.endswith("norm")} == set(norms.values())


def _norm_weights(layer) -> None:
    with torch.no_grad():
        for name, child in layer.named_children():
            if name.endswith("norm"):
                child.weight.normal_()


def test_parallel_branches_compose_as_documented():
    """Sandwich and post_sublayer branches, and cross-attention as a third branch."""
    torch.manual_seed(0)
    x = torch.randn(B, T, D)
    for norm in ({"type": "rmsnorm", "placement": "sandwich"}, POST_SUBLAYER):
        layer = build_model(_spec(parallel_residual=True, norm=norm), attention_backend="eager").decoder.layers[0]
        _norm_weights(layer)
        inputs = AttentionInputs(0, T)
        a, f = (lambda h: layer.attention(h, inputs)), layer.ffn
        with torch.no_grad():
            if norm["placement"] == "sandwich":
                ref = (
                    x
                    + layer.attention_post_norm(a(layer.attention_norm(x)))
                    + layer.ffn_post_norm(f(layer.ffn_norm(x)))
                )
            else:
                ref = x + layer.attention_norm(a(x)) + layer.ffn_norm(f(x))
            torch.testing.assert_close(layer(x, inputs), ref)
    model = build_model(_spec("encoder-decoder", parallel_residual="shared_norm"), attention_backend="eager")
    layer, memory = model.decoder.layers[0], torch.randn(B, 7, D)
    _norm_weights(layer)
    inputs, memory_inputs = AttentionInputs(0, T), AttentionInputs(0, T)
    with torch.no_grad():
        h = layer.attention_norm(x)
        ref = x + layer.attention(h, inputs) + layer.cross_attention(h, memory_inputs, memory=memory) + layer.ffn(h)
        torch.testing.assert_close(layer(x, inputs, memory=memory, memory_inputs=memory_inputs), ref)


def test_parallel_layer_needs_its_norms():
    from yamlformer.blocks.layers import TransformerLayer

    layer = build_model(_spec(parallel_residual="shared_norm")).decoder.layers[0]
    with pytest.raises(ValueError, match="shared_norm parallel layer needs norms"):
        TransformerLayer(
            layer.attention,
            layer.ffn,
            {"attention_norm": layer.attention_norm, "ffn_norm": nn.Identity()},
            parallel_residual="shared_norm",
        )
    with pytest.raises(ValueError, match="placement post has none"):
        TransformerLayer(layer.attention, layer.ffn, {}, placement="post", parallel_residual=True)
    with pytest.raises(ValueError, match="parallel_residual must be"):
        TransformerLayer(layer.attention, layer.ffn, {}, parallel_residual="yes")


# -- MoE blocks against Hugging Face's ---------------------------------------------------------


def _ffn(config: dict) -> nn.Module:
    cls = spec_model().model_fields["decoder"].annotation.__args__[0].model_fields["ffn"].annotation
    from pydantic import TypeAdapter

    block = TypeAdapter(cls).validate_python(config)
    torch.manual_seed(0)
    module = build_block(block, Dims(d_model=D, vocab_size=VOCAB, max_seq_len=MAX_SEQ))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


def test_gpt_oss_moe_matches_hugging_face():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    ours = _ffn(GPT_OSS)
    config = transformers.GptOssConfig(
        hidden_size=D, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0
    )
    hf = GptOssMLP(config)
    with torch.no_grad():
        hf.router.load_state_dict(ours.router.state_dict())
        gate, up, down = ours.experts.gate_proj, ours.experts.up_proj, ours.experts.down_proj  # stacked
        hf.experts.gate_up_proj[..., ::2] = gate.weight.transpose(1, 2)  # interleaved: gate even, up odd
        hf.experts.gate_up_proj[..., 1::2] = up.weight.transpose(1, 2)
        hf.experts.gate_up_proj_bias[:, ::2] = gate.bias
        hf.experts.gate_up_proj_bias[:, 1::2] = up.bias
        hf.experts.down_proj.copy_(down.weight.transpose(1, 2))
        hf.experts.down_proj_bias.copy_(down.bias)
        x = 2 * torch.randn(B, T, D)
        up = torch.einsum("btd,ehd->ebth", x, up.weight) + up.bias[:, None, None]  # every expert's up_proj
        assert (up.abs() > 7.0).any() and (up.abs() < 7.0).any()  # the clamps bite, and not everywhere
        torch.testing.assert_close(ours(x), hf(x)[0], rtol=1e-4, atol=1e-4)


def test_llama4_moe_matches_hugging_face():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    ours = _ffn(LLAMA4)
    config = transformers.Llama4TextConfig(
        hidden_size=D, intermediate_size=16, num_local_experts=4, num_experts_per_tok=1, hidden_act="silu"
    )
    hf = Llama4TextMoe(config)
    with torch.no_grad():
        hf.router.weight.copy_(ours.router.weight)
        gate, up = ours.experts.gate_proj.weight, ours.experts.up_proj.weight  # (E, hidden, d_model)
        hf.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1).transpose(1, 2))  # gate then up
        hf.experts.down_proj.copy_(ours.experts.down_proj.weight.transpose(1, 2))
        hf.shared_expert.load_state_dict(ours.shared_experts.state_dict())
        x = torch.randn(B, T, D)
        expected = hf(x)[0].reshape(B, T, D)
        torch.testing.assert_close(ours(x), expected, rtol=1e-4, atol=1e-4)
        ours.on_input = False  # the weight on the output instead: a different block
        assert not torch.allclose(ours(x), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_is_expressible(norm_topk_prob):
    """qwen3_moe with norm_topk_prob is ``moe``; without, ``deepseek_moe`` with softmax scores."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    expert = {"type": "glu", "hidden_dim": 16}
    if norm_topk_prob:
        ours = _ffn({"type": "moe", "n_experts": 4, "top_k": 2, "expert": expert})
    else:
        ours = _ffn({"type": "deepseek_moe", "n_experts": 4, "top_k": 2, "expert": expert})
    stacked = {n: getattr(ours.experts, n).weight for n in ("gate_proj", "up_proj", "down_proj")}
    config = transformers.Qwen3MoeConfig(
        hidden_size=D, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob
    )
    hf = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1))
        hf.experts.down_proj.copy_(stacked["down_proj"])
        x = torch.randn(B, T, D)
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-4, atol=1e-4)


# -- counts ----------------------------------------------------------------------------------------


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {key: n for key, n in counts.items() if n}


@pytest.mark.parametrize("name", sorted(CASES))
def test_counts_equal_the_built_model(name):
    spec = _case(name)
    model = build_model(spec, device="meta")
    est = estimate(spec, seq_len=T, src_len=9 if spec.architecture == "encoder-decoder" else None)
    assert actual_params(model) == _nonzero(est.params.by_component)
    for stack_name, stack in spec.stacks().items():
        cross = stack_name in spec.architecture_config.memory_of
        for i, layer in enumerate(stack.layers()):
            built = getattr(model, stack_name).layers[i]
            assert layer.param_shapes(D, cross) == {n: tuple(p.shape) for n, p in built.named_parameters()}
    layer_tensors = sum(len(list(getattr(model, name).layers.parameters())) for name in spec.stacks())
    assert layer_tensor_count(spec) == layer_tensors  # the layout's walk (FSDP's optimizer steps)
    torch.manual_seed(0)
    model = build_model(spec, attention_backend="eager").eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        _forward(model, spec, torch.randint(0, VOCAB, (1, T)))
    assert counter.get_total_flops() == est.flops.forward_per_sequence


def test_active_params_count_top_k_experts():
    for ffn, moe_layers in ((GPT_OSS, 2), (LLAMA4, 2)):
        spec = _spec(ffn=ffn)
        model = build_model(spec, device="meta")
        block = model.decoder.layers[0].ffn
        experts = block.experts
        per_expert = (
            sum(p.numel() for p in experts[0].parameters())
            if isinstance(experts, nn.ModuleList)
            else sum(p.numel() for p in experts.parameters()) // ffn["n_experts"]
        )
        est = estimate(spec).params
        idle = ffn["n_experts"] - ffn["top_k"]
        assert est.active == est.total - moe_layers * idle * per_expert


def _saved(spec, dtype, backend: str) -> int:
    """The bytes autograd keeps over one forward (parameters aside), and the logits."""
    torch.manual_seed(0)
    model = build_model(spec, attention_backend=backend, dtype=dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    ids = torch.randint(0, VOCAB, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = _forward(model, spec, ids)
        F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    return sum(saved.values()) + logits.numel() * logits.element_size()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_bytes_are_what_autograd_keeps(name, dtype, backend):
    """Exact: what the option changes in the estimate is what it changes in the saved tensors."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    spec, base = _case(name), _case(name, 1)
    src = 9 if spec.architecture == "encoder-decoder" else None

    def est(s):
        fused = backend != "eager"
        return estimate(s, seq_len=T, src_len=src, batch=B, dtype=dtype, fused_attention=fused).memory.activations

    saved = _saved(spec, torch_dtype, backend) - _saved(base, torch_dtype, backend)
    assert est(spec) - est(base) == saved


# -- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["post_sublayer", "parallel", "parallel-shared_norm", "gpt_oss-moe", "llama4-moe-interleaved"]
)
def test_cached_and_static_decoding_equal_recomputation(name):
    spec = _case(name)
    torch.manual_seed(0)
    model = build_model(spec, attention_backend="eager").eval()
    for layer in model.decoder.layers:
        _norm_weights(layer)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=gen)
    cached = model.generate(prompt, max_new_tokens=10)
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=10, use_cache=False))
    seq = torch.randint(0, VOCAB, (2, 16), generator=gen)
    with torch.no_grad():
        full = model(seq)
        cache = KVCache.for_stack(model.decoder, 2, 16, torch.float32, "cpu")
        parts = [model(seq[:, :6], cache=cache)] + [model(seq[:, i : i + 1], cache=cache) for i in range(6, 16)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)
        cache = KVCache.for_stack(model.decoder, 2, 16, torch.float32, "cpu")
        model(seq[:, :6], cache=cache)
        positions = torch.arange(16).expand(2, 16)
        steps = []
        for i in range(6, 16):
            steps.append(model._decode_step(seq[:, i : i + 1], torch.tensor([i]), positions, cache, None, None, None))
            cache.advance(1)
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 6:], rtol=1e-4, atol=1e-5)


def test_a_head_layer_takes_its_stack_parallel_residual():
    spec = _case("mtp-parallel")
    assert spec.head.layer.parallel_residual is True
    model = build_model(spec)
    assert model.head.mtp[0].layer.parallel_residual is True and model.decoder.layers[0].parallel_residual is True
    own = _spec(parallel_residual=True, head={"type": "mtp", "layer": {"parallel_residual": "shared_norm"}})
    assert build_model(own).head.mtp[0].layer.parallel_residual == "shared_norm"


# -- located errors ----------------------------------------------------------------------------


def _located(tmp_path, **stack):
    """The first problem ``yamlformer.builder.load_spec`` reports for the spec file: (field path, line, message)."""
    import yaml

    from yamlformer.builder.spec.loader import load_spec
    from yamlformer.builder.spec.source import SpecError

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec_data(**stack), sort_keys=False))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    problem = info.value.problems[0]
    return problem.path, problem.line, problem.message


def _line(tmp_path, key: str) -> int:
    """The 1-based line of the first ``key:`` in the spec file just written."""
    lines = (tmp_path / "spec.yaml").read_text().splitlines()
    return next(i for i, text in enumerate(lines, start=1) if text.strip().startswith(f"{key}:"))


def test_bad_combinations_are_located_errors(tmp_path):
    sandwich = {"type": "rmsnorm", "placement": "sandwich"}
    path, line, message = _located(tmp_path, parallel_residual="shared_norm", norm=sandwich)
    assert path == "decoder.parallel_residual" and line == _line(tmp_path, "parallel_residual")
    assert "needs norm placement pre, got sandwich" in message
    overrides = [{"layers": [1], "norm": {"type": "layernorm", "placement": "post"}}]
    path, _, message = _located(tmp_path, parallel_residual=True, overrides=overrides)
    assert path == "decoder.parallel_residual" and "got post" in message and "(layer 1)" in message
    path, line, message = _located(tmp_path, ffn={**GPT_OSS, "expert": {"type": "mlp"}})
    assert path == "decoder.ffn.clamp" and "needs a glu expert" in message
    assert line == _line(tmp_path, "clamp") + 1  # the mapping's first line
    path, _, _ = _located(tmp_path, ffn={**GPT_OSS, "clamp": {"alpha": 1.0, "limit": -1.0}})
    assert path == "decoder.ffn.clamp.limit"
    path, _, message = _located(tmp_path, ffn={**GPT_OSS, "expert": {"type": "glu", "bias": False}})
    assert path == "decoder.ffn.expert_bias" and "contradicts" in message
    path, _, _ = _located(tmp_path, parallel_residual="both")
    assert path == "decoder.parallel_residual"
    path, _, _ = _located(tmp_path, ffn={**LLAMA4, "weight_on": "gate"})
    assert path == "decoder.ffn.weight_on"
    head = {"type": "mtp", "layer": {"parallel_residual": "shared_norm", "norm": sandwich}}
    path, _, message = _located(tmp_path, head=head)
    assert path == "head.layer.parallel_residual" and "pre" in message


def test_describe_names_the_wiring():
    assert _case("parallel").decoder.layer(0).describe(cross=False).endswith("layernorm parallel")
    assert _case("parallel-shared_norm").decoder.layer(0).describe(cross=False).endswith("parallel shared_norm")
    assert _case("post_sublayer").decoder.layer(0).describe(cross=False).endswith("rmsnorm post_sublayer")
