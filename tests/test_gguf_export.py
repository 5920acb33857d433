"""``builder export-gguf`` without llama.cpp: what it refuses (before writing, in one line naming
the field llama.cpp lacks) and what it writes (names, layouts, keys, read back with gguf's own
reader). llama.cpp running the files: tests/test_gguf_llamacpp.py (``pytest -m llamacpp``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from yamlformer.builder.cli import main


def _refused(tmp_path: Path, capsys, *args: str) -> str:
    out = tmp_path / "x.gguf"
    assert main(["export-gguf", *args, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".x.gguf*")), "a refusal wrote a file"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


#: Llama 4's NoPE layer as llama.cpp fixes it, and tiny/llama4's layers with it
L4_NOPE = "{rope: false, chunk_size: null, qk_norm: null, temperature_tuning: {floor_scale: 8192, scale: 0.1}}"
L4_LAYERS = f"decoder.overrides=[{{layers: '3::4', attention: {L4_NOPE}}}]"
L4_DENSE = "{type: glu, activation: silu, hidden_dim: 96}"


@pytest.mark.parametrize(
    ("spec", "sets", "field"),
    [
        ("tiny/t5", [], "architecture: encoder-decoder"),
        ("tiny/bert", [], "architecture: encoder-only"),
        ("tiny/diff-transformer", [], "decoder.attention.type: 'differential'"),
        ("tiny/transformer", [], "architecture: encoder-decoder"),
        ("tiny/llama", ["position={type: sinusoidal}"], "position.type: 'sinusoidal'"),
        ("tiny/llama", ["position={type: none}"], "position.type: 'none'"),
        # Mistral's window: llama.cpp's llama graph has no window, it would attend over everything
        ("mistral-7b", [], "decoder.attention.sliding_window (config sliding_window): 4096"),
        (
            "tiny/llama",
            ["position={type: rope, scaling: {type: yarn, factor: 4.0, original_max_seq_len: 16}}"],
            "position.scaling (config rope_scaling): 'yarn'",
        ),
        # Llama 3's factors are written for llama.cpp's llama graph only
        (
            "tiny/qwen3",
            ["position={type: rope, scaling: {type: llama3, factor: 8.0, original_max_seq_len: 16}}"],
            "position.scaling (config rope_scaling): 'llama3' RoPE scaling is not written for this architecture",
        ),
        ("tiny/llama", ["decoder.ffn.activation=gelu"], "decoder.ffn.activation (config hidden_act): 'gelu"),
        ("tiny/gpt2", ["decoder.ffn.activation=relu"], "decoder.ffn.activation (config activation_function): 'relu'"),
        ("tiny/qwen3", ["decoder.attention.sliding_window=8"], "decoder.attention.sliding_window"),
        ("tiny/qwen3-moe", ["decoder.ffn.norm_topk_prob=false"], "decoder.ffn.norm_topk_prob: false"),
        # llama.cpp's gemma2 always caps, and fixes the score scale by the model's shape
        ("tiny/gemma2", ["decoder.attention.softcap=null"], "decoder.attention.softcap / head.softcap: none"),
        ("tiny/gemma2", ["decoder.attention.scale=0.1"], "decoder.attention.scale (config query_pre_attn_scalar)"),
        # llama.cpp's mpt fixes the score scale at 1/sqrt(head_dim)
        ("tiny/alibi", ["decoder.attention.scale=0.1"], "decoder.attention.scale (config attn_config.softmax_scale)"),
        # DeepSeek-V2: its groups ranked by their best expert (llama.cpp: top-2 sum); llama.cpp's YaRN
        # takes mscale equal to mscale_all_dim
        ("tiny/deepseek-v2", [], "decoder.ffn.topk_groups (config topk_group): 2 of 4 groups"),
        (
            "tiny/deepseek-v2",
            ["decoder.ffn.n_groups=1", "decoder.ffn.topk_groups=1", "position.scaling.mscale=1.0"],
            "position.scaling.mscale / mscale_all_dim: 1.0, 0.707",
        ),
        (
            "tiny/deepseek-v2",
            ["position.scaling=null", "decoder.ffn.n_groups=1", "decoder.ffn.topk_groups=1", "decoder.norm.eps=1e-5"],
            "decoder.norm.eps (config rms_norm_eps): 1e-05; llama.cpp's deepseek2 normalizes the latents with it",
        ),
        # GPT-OSS: llama.cpp's YaRN has whole-dimension ramp ends, its clamped SwiGLU fixed constants
        ("tiny/gpt-oss", [], "position.scaling.truncate (config rope_parameters.truncate): false"),
        (
            "tiny/gpt-oss",
            ["position.scaling=null", "decoder.ffn.clamp.limit=5.0"],
            "decoder.ffn.clamp (config swiglu_alpha, swiglu_limit): 1.702, 5.0",
        ),
        # Llama 4: llama.cpp fixes chunks and the NoPE temperature (8192), NoPE layers (every 4th),
        # QK norms (unless 128 experts) and experts every n-th layer
        (
            "tiny/llama4",
            [],
            "decoder.attention.chunk_size (config attention_chunk_size, layer_types): layer 0 chunked by 8",
        ),
        (
            "tiny/llama4",
            ["decoder.attention.chunk_size=64"],
            "decoder.overrides attention.temperature_tuning (config floor_scale, attn_scale): 4, 0.1; llama.cpp's",
        ),
        (
            "tiny/llama4",
            ["decoder.attention.chunk_size=64", f"decoder.overrides=[{{layers: '2::4', attention: {L4_NOPE}}}]"],
            "decoder.overrides attention.rope (config no_rope_layers): NoPE layers [2]",
        ),
        (
            "tiny/llama4",
            ["decoder.attention.chunk_size=64", L4_LAYERS, "decoder.ffn.n_experts=128"],
            "decoder.attention.qk_norm (config use_qk_norm): True with 128 experts",
        ),
        (
            "tiny/llama4",
            ["decoder.attention.chunk_size=64", L4_LAYERS.replace("[", f"[{{layers: '1', ffn: {L4_DENSE}}}, ", 1)],
            "decoder.overrides (config moe_layers): experts on layers [0, 2, 3]",
        ),
        (
            "tiny/llama4",
            ["decoder.attention.chunk_size=64", L4_LAYERS, "decoder.attention.qkv_bias=true"],
            "decoder.attention.qkv_bias (config attention_bias)",
        ),
    ],
)
def test_a_spec_llama_cpp_cannot_run_is_refused_naming_the_field(spec, sets, field, tmp_path, capsys):
    args = [spec, "--init", *[a for s in sets for a in ("--set", s)]]
    line = _refused(tmp_path, capsys, *args)
    assert field in line, line


def test_a_family_without_a_proven_architecture_is_refused_with_the_ones_there_are(tmp_path, capsys):
    line = _refused(tmp_path, capsys, "tiny/deepseek-v3", "--init", "--set", "head={type: lm}")
    assert "Hugging Face deepseek_v3" in line and "llama4_text" in line, line


def test_the_weights_and_the_output_are_checked_first(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text("extends: tiny/llama\nname: mine\n")
    line = _refused(tmp_path, capsys, str(spec))
    assert "no weights file" in line and "--init" in line, line
    (tmp_path / "x.gguf").write_text("keep")
    assert main(["export-gguf", str(spec), "--init", "-o", str(tmp_path / "x.gguf")]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "x.gguf").read_text() == "keep"
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)  # nor is anything but a regular file replaced, --overwrite or not
    assert main(["export-gguf", "tiny/llama", "--init", "--overwrite", "-o", str(fifo)]) == 1
    assert "is a FIFO (named pipe)" in capsys.readouterr().err and fifo.exists() and not fifo.is_file()


def test_an_untrained_spec_is_written_as_llama_with_its_keys_and_rope_layout(tmp_path, capsys):
    """The q/k rows llama.cpp's llama graph rotates as interleaved pairs: Hugging Face's halves
    permuted, per head (convert_hf_to_gguf's permutation), k by its own (grouped) head count."""
    gguf = pytest.importorskip("gguf")
    import torch

    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.hf.writer import hf_tensors
    from yamlformer.builder.spec.loader import load_spec

    out = tmp_path / "m.gguf"
    assert main(["export-gguf", "tiny/llama", "--init", "--seed", "5", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "random weights (--init, seed 5): untrained" in said and "no tokenizer" in said
    reader = gguf.GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    spec = load_spec("tiny/llama")
    assert fields["general.architecture"] == "llama"
    assert fields["general.description"] == "random weights (--init, seed 5): untrained"
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.block_count"] == spec.decoder.n_layers
    assert fields["llama.context_length"] == spec.max_seq_len
    assert fields["tokenizer.ggml.model"] == "none"
    tensors = {t.name: t for t in reader.tensors}
    torch.manual_seed(5)
    _, config, hf, _ = hf_tensors(spec, build_model(spec))
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    head = 16
    ours_q = q.reshape(4, 2, head // 2, -1).transpose(1, 2).reshape(q.shape)
    ours_k = k.reshape(2, 2, head // 2, -1).transpose(1, 2).reshape(k.shape)
    assert torch.equal(torch.from_numpy(tensors["blk.0.attn_q.weight"].data.copy()), ours_q)
    assert torch.equal(torch.from_numpy(tensors["blk.0.attn_k.weight"].data.copy()), ours_k)
    v = hf["model.layers.0.self_attn.v_proj.weight"]
    assert torch.equal(torch.from_numpy(tensors["blk.0.attn_v.weight"].data.copy()), v)
    assert "output.weight" in tensors  # tiny/llama's head is untied
    assert len(tensors) == len(hf)


def test_outtype_q8_0_quantizes_matrices_and_keeps_norms(tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", "tiny/llama", "--init", "--outtype", "q8_0", "-o", str(out)]) == 0
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert kinds["blk.0.attn_q.weight"] == "Q8_0" and kinds["token_embd.weight"] == "Q8_0"
    assert kinds["blk.0.attn_norm.weight"] == "F32"
    assert kinds["blk.0.ffn_down.weight"] == "F16"  # rows of 172: not a multiple of Q8_0's 32-wide blocks


def test_outtype_q8_0_keeps_stacked_expert_biases_f32(tmp_path, capsys):
    """GPT-OSS's experts' biases are 2-D (experts, width); ggml adds only f32 (a q8_0 one aborts
    llama.cpp: ops.cpp's GGML_ASSERT(src1->type == GGML_TYPE_F32))."""
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "m.gguf"
    args = ["tiny/gpt-oss", "--init", "--set", "position.scaling.truncate=true", "--outtype", "q8_0"]
    assert main(["export-gguf", *args, "-o", str(out)]) == 0
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == "Q8_0"
    assert {kinds[f"blk.0.ffn_{p}_exps.bias"] for p in ("gate", "up", "down")} == {"F32"}


def test_export_hf_init_writes_the_spec_untrained(tmp_path, capsys):
    """export-hf --init: the random weights the spec's initialization draws from the seed, read
    back by import; a spec without weights and without --init says how to get them."""
    import torch

    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.hf import from_hf, load_weights
    from yamlformer.builder.spec.loader import load_spec

    out = tmp_path / "hf"
    assert main(["export-hf", "tiny/llama", "--init", "--seed", "4", "-o", str(out)]) == 0
    assert "random weights (--init, seed 4): untrained" in capsys.readouterr().out
    spec, state = from_hf(out)
    back = load_weights(build_model(spec), state).eval()
    torch.manual_seed(4)
    ours = build_model(load_spec("tiny/llama")).eval()
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(x), ours(x))
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("extends: tiny/llama\nname: mine\n")
    assert main(["export-hf", str(spec_file), "-o", str(tmp_path / "none")]) == 1
    assert "--init" in capsys.readouterr().err


def test_a_tokenizer_llama_cpp_does_not_reproduce_is_refused_naming_its_part():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from yamlformer.builder.gguf.vocab import VocabError, check_vocab

    def state(tokenizer) -> dict:
        return {"type": "tokenizers", "json": tokenizer.to_str(), "specials": {}}

    byte_level = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert "byte-level BPE" in check_vocab(state(byte_level))
    prefixed = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    metaspace = Tokenizer(models.BPE(vocab={"a": 0}, merges=[], byte_fallback=True))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    normalized = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    normalized.normalizer = normalizers.NFKC()
    for tokenizer, part in [(prefixed, "pre-tokenizer"), (metaspace, "byte fallback"), (normalized, "normalizer")]:
        with pytest.raises(VocabError, match=part):
            check_vocab(state(tokenizer))


LORA = "adapters={type: lora, rank: 2, alpha: 4, targets: all-linear}"


@pytest.mark.parametrize(
    ("spec", "args", "field"),
    [
        ("tiny/llama", ["--set", LORA.replace("lora,", "dora,")], "adapters.type: dora; llama.cpp applies LoRA"),
        (
            "tiny/mixtral",
            ["--set", LORA],
            "a GGUF LoRA adapter for llama.cpp's llama is written (and proven) for llama only",
        ),
        ("tiny/gemma2", ["--set", LORA], "a GGUF LoRA adapter for llama.cpp's gemma2 is written (and proven) for none"),
        ("tiny/llama", [], "--adapters-only: the model has no adapters"),
        ("tiny/llama", ["--set", LORA, "--merge"], "--merge and --adapters-only: give one"),
    ],
)
def test_adapters_llama_cpp_cannot_apply_are_refused_in_one_line(spec, args, field, tmp_path, capsys):
    line = _refused(tmp_path, capsys, spec, "--init", "--adapters-only", *args)
    assert field in line, line


def test_adapters_only_writes_a_gguf_lora_adapter(tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "a.gguf"
    assert main(["export-gguf", "tiny/llama", "--init", "--set", LORA, "--adapters-only", "-o", str(out)]) == 0
    assert "adapters alone" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["adapter.lora.alpha"].contents() == pytest.approx(4.0)
    tensors = {t.name: t for t in reader.tensors}
    assert all(name.endswith((".lora_a", ".lora_b")) for name in tensors), sorted(tensors)
    a, b = tensors["blk.0.attn_q.weight.lora_a"], tensors["blk.0.attn_q.weight.lora_b"]
    assert a.data.shape[0] == 2 and b.data.shape[1] == 2  # (rank, in), (out, rank)


def test_phi3_is_written_without_a_window_only_where_the_window_masks_nothing(tmp_path, capsys):
    """llama.cpp's phi3 disables sliding windows: a window below max_seq_len (64) is refused, one
    at least as long (or none) is written as llama.cpp's phi3 with q, k, v and gate, up fused,
    no window key, and no general.name (llama.cpp's tokenizer keys special-token stripping on
    a name with "phi3" in it)."""
    gguf = pytest.importorskip("gguf")
    line = _refused(tmp_path, capsys, "tiny/phi3", "--init", "--family", "phi3")
    assert "decoder.attention.sliding_window (config sliding_window): 8 < max_seq_len 64" in line, line
    for window in ("64", "null"):
        out = tmp_path / f"{window}.gguf"
        args = ["tiny/phi3", "--init", "--family", "phi3", "--set", f"decoder.attention.sliding_window={window}"]
        assert main(["export-gguf", *args, "-o", str(out)]) == 0
        assert "llama.cpp phi3 (from Hugging Face phi3)" in capsys.readouterr().out
        reader = gguf.GGUFReader(str(out))
        fields = {k: f.contents() for k, f in reader.fields.items()}
        assert fields["general.architecture"] == "phi3" and "general.name" not in fields
        assert not any("sliding_window" in k for k in fields), fields
        shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
        assert shapes["blk.0.attn_qkv.weight"] == (64, 64 + 2 * 32)  # 4 query heads, 2 key/value, of 16
        assert shapes["blk.0.ffn_up.weight"] == (64, 2 * 128)  # gate rows, then up
        assert "blk.0.attn_q.weight" not in shapes and "blk.0.ffn_gate.weight" not in shapes


def test_mistral_is_written_as_llama_without_a_window_only_where_the_window_masks_nothing(tmp_path, capsys):
    """llama.cpp's llama graph (which runs Mistral) has no window: one below max_seq_len (64) is
    refused, one at least as long masks nothing and is written as llama with no window key."""
    gguf = pytest.importorskip("gguf")
    line = _refused(tmp_path, capsys, "tiny/llama", "--init", "--set", "decoder.attention.sliding_window=63")
    assert "decoder.attention.sliding_window (config sliding_window): 63 < max_seq_len 64" in line, line
    for window in (64, 1000):
        out = tmp_path / f"{window}.gguf"
        args = ["tiny/llama", "--init", "--set", f"decoder.attention.sliding_window={window}"]
        assert main(["export-gguf", *args, "-o", str(out)]) == 0
        assert "llama.cpp llama (from Hugging Face mistral)" in capsys.readouterr().out
        fields = {k: f.contents() for k, f in gguf.GGUFReader(str(out)).fields.items()}
        assert fields["general.architecture"] == "llama" and fields["llama.context_length"] == 64
        assert not any("sliding_window" in k for k in fields), fields


def test_llama4_is_written_as_llama_cpps_with_its_experts_split_and_chunks_as_its_pattern(tmp_path, capsys):
    """Dense even layers, experts every 2nd (interleave step 2), transformers' fused gate_up split
    into gate and up and transposed, down transposed, q/k unpermuted (both interleave), the
    chunked layers as llama.cpp's pattern, Llama 3's factors (equal low and high: no band)."""
    gguf = pytest.importorskip("gguf")
    import torch
    import yaml

    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.hf.writer import hf_tensors
    from yamlformer.builder.spec.loader import load_spec

    layers = [
        {"layers": "0::2", "ffn": yaml.safe_load(L4_DENSE)},
        {"layers": "3::4", "attention": yaml.safe_load(L4_NOPE)},
    ]
    spec = {"extends": "tiny/llama4", "name": "l4", "decoder": {"attention": {"chunk_size": 64}, "overrides": layers}}
    path = tmp_path / "llama4.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", str(path), "--init", "--seed", "2", "-o", str(out)]) == 0
    assert "llama.cpp llama4 (from Hugging Face llama4_text)" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["llama4.interleave_moe_layer_step"] == 2 and fields["llama4.expert_feed_forward_length"] == 64
    assert fields["llama4.feed_forward_length"] == 96 and fields["llama4.expert_used_count"] == 1
    assert fields["llama4.attention.sliding_window_pattern"] == [True, True, True, False]
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    spec = load_spec(path)
    torch.manual_seed(2)
    _, _, hf, _ = hf_tensors(spec, build_model(spec))
    gate_up = hf["model.layers.1.feed_forward.experts.gate_up_proj"]  # (experts, d, 2 * hidden)
    assert torch.equal(tensors["blk.1.ffn_gate_exps.weight"], gate_up[..., :64].transpose(1, 2))
    assert torch.equal(tensors["blk.1.ffn_up_exps.weight"], gate_up[..., 64:].transpose(1, 2))
    down = hf["model.layers.1.feed_forward.experts.down_proj"]
    assert torch.equal(tensors["blk.1.ffn_down_exps.weight"], down.transpose(1, 2))
    assert torch.equal(tensors["blk.0.attn_q.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    assert "blk.0.ffn_gate.weight" in tensors and "blk.1.ffn_gate_shexp.weight" in tensors
    assert set(tensors["rope_freqs.weight"].tolist()) <= {1.0, 4.0}


def _ggml_alibi_slopes(n_heads: int, max_bias: float = 8.0) -> list[float]:
    """ggml's ALiBi slopes, as its soft_max computes them (ggml-cpu/ops.cpp, float32 powf)."""
    import numpy as np

    n = 2 ** int(np.floor(np.log2(n_heads)))
    m0, m1 = np.float32(2.0) ** np.float32(-max_bias / n), np.float32(2.0) ** np.float32(-max_bias / 2 / n)
    return [float(m0 ** (h + 1) if h < n else m1 ** (2 * (h - n) + 1)) for h in range(n_heads)]


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 48, 56, 64, 71, 96, 128])
def test_our_alibi_slopes_are_llama_cpps_for_each_head_count(n_heads):
    """What llama.cpp's mpt computes from max_alibi_bias 8 is our ALiBi, powers of two or not."""
    import torch

    from yamlformer.blocks.positions import alibi_slopes

    theirs = torch.tensor(_ggml_alibi_slopes(n_heads))
    assert torch.allclose(alibi_slopes(n_heads), theirs, rtol=1e-6, atol=0), n_heads


def test_mpt_is_written_with_its_alibi_bias_and_fused_qkv(tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", "tiny/alibi", "--init", "-o", str(out)]) == 0
    assert "llama.cpp mpt (from Hugging Face mpt)" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["mpt.attention.max_alibi_bias"] == 8.0 and fields["mpt.feed_forward_length"] == 256
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert shapes["blk.0.attn_qkv.weight"] == (64, 3 * 64)
    assert "output.weight" not in shapes and "position_embd.weight" not in shapes  # tied; ALiBi, no table


def test_deepseek_v2_is_written_as_llama_cpps_absorbed_latent_attention(tmp_path, capsys):
    """kv_b_proj split per head into k_b (its key rows transposed) and v_b, as llama.cpp's deepseek2
    multiplies them; the MLA ranks and dims as its keys; a compressed query as q_a, q_b."""
    gguf = pytest.importorskip("gguf")
    import torch

    from yamlformer.builder.hf.writer import hf_tensors, random_weights
    from yamlformer.builder.spec.loader import load_spec

    sets = {"position.scaling": None, "decoder.ffn.n_groups": 1, "decoder.ffn.topk_groups": 1}
    sets["decoder.attention.q_lora_rank"] = 24
    args = [a for key, value in sets.items() for a in ("--set", f"{key}={'null' if value is None else value}")]
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", "tiny/deepseek-v2", "--init", *args, "-o", str(out)]) == 0
    assert "llama.cpp deepseek2 (from Hugging Face deepseek_v2)" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    keys = {k.removeprefix("deepseek2."): v for k, v in fields.items() if k.startswith("deepseek2.")}
    assert keys["attention.q_lora_rank"] == 24 and keys["attention.kv_lora_rank"] == 32
    assert keys["attention.key_length_mla"] == 24 and keys["attention.value_length_mla"] == 16
    assert keys["rope.dimension_count"] == 8 and keys["leading_dense_block_count"] == 1
    assert keys["expert_shared_count"] == 2 and keys["expert_weights_scale"] == 2.0
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    assert {"blk.0.attn_q_a.weight", "blk.0.attn_q_a_norm.weight", "blk.0.attn_q_b.weight"} <= set(tensors)
    spec = load_spec("specs/tiny/deepseek-v2.yaml", sets)
    kv_b = hf_tensors(spec, random_weights(spec, 0))[2]["model.layers.0.self_attn.kv_b_proj.weight"]
    per_head = kv_b.reshape(4, 16 + 16, 32)  # (heads, nope + v rows, kv_lora_rank)
    assert torch.equal(tensors["blk.0.attn_k_b.weight"], per_head[:, :16].transpose(1, 2))
    assert torch.equal(tensors["blk.0.attn_v_b.weight"], per_head[:, 16:])


def test_gpt_oss_experts_are_written_as_llama_cpps_separate_gate_and_up(tmp_path, capsys):
    """transformers' fused, interleaved, transposed experts as llama.cpp's gpt-oss stacks them;
    the sinks, and the window as its per-layer pattern (even layers banded)."""
    gguf = pytest.importorskip("gguf")
    import torch

    from yamlformer.builder.hf.writer import hf_tensors, random_weights
    from yamlformer.builder.spec.loader import load_spec

    out = tmp_path / "m.gguf"
    assert main(["export-gguf", "tiny/gpt-oss", "--init", "--set", "position.scaling=null", "-o", str(out)]) == 0
    assert "(from Hugging Face gpt_oss)" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(out))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "gpt-oss"
    assert fields["gpt-oss.attention.sliding_window"] == 8
    assert fields["gpt-oss.attention.sliding_window_pattern"] == [True, False]
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    spec = load_spec("specs/tiny/gpt-oss.yaml", {"position.scaling": None})
    hf = hf_tensors(spec, random_weights(spec, 0))[2]
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]  # (experts, d, 2 * hidden), interleaved
    assert torch.equal(tensors["blk.1.ffn_gate_exps.weight"], gate_up[..., ::2].transpose(1, 2))
    assert torch.equal(tensors["blk.1.ffn_up_exps.weight"], gate_up[..., 1::2].transpose(1, 2))
    assert torch.equal(tensors["blk.1.ffn_up_exps.bias"], hf["model.layers.1.mlp.experts.gate_up_proj_bias"][:, 1::2])
    assert torch.equal(
        tensors["blk.1.ffn_down_exps.weight"], hf["model.layers.1.mlp.experts.down_proj"].transpose(1, 2)
    )
    assert torch.equal(tensors["blk.1.attn_sinks.weight"], hf["model.layers.1.self_attn.sinks"])


@pytest.mark.parametrize(
    ("spec", "sets", "keys"),
    [
        # DeepSeek's: mscale_all_dim as convert_hf_to_gguf writes it (0.1 times), read back over 0.1
        (
            "tiny/deepseek-v2",
            ["decoder.ffn.n_groups=1", "decoder.ffn.topk_groups=1"],
            {"factor": 40.0, "original_context_length": 4096, "yarn_log_multiplier": 0.0707},
        ),
        ("tiny/gpt-oss", ["position.scaling.truncate=true"], {"factor": 4.0, "original_context_length": 16}),
    ],
)
def test_yarn_is_written_as_llama_cpp_reads_it(spec, sets, keys, tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", spec, "--init", *[a for s in sets for a in ("--set", s)], "-o", str(out)]) == 0
    fields = {k.split(".rope.scaling.")[-1]: f.contents() for k, f in gguf.GGUFReader(str(out)).fields.items()
              if ".rope.scaling." in k}  # fmt: skip
    assert fields.pop("type") == "yarn" and fields.pop("yarn_beta_fast") == 32.0 and fields.pop("yarn_beta_slow") == 1.0
    assert fields == pytest.approx(keys), fields
