"""``builder export-gguf`` proven by llama.cpp itself (llama-cpp-python built by .ci/llamacpp.sh):
for each model, llama.cpp's tokenizer gives our ids for the prompts (text in), its greedy tokens
equal ``builder generate --temperature 0``'s over 7 prompts x 24 tokens, and its first-step
logits agree with ours within :data:`F32_TOLERANCE` (f32 file) or :data:`TOLERANCES` (f16, bf16, q8_0).

    .ci/llamacpp.sh && python -m pytest -m llamacpp -n 0 tests/test_gguf_llamacpp.py
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from gguf_helpers import EXPORT_ARGS, FAMILIES, LLAMA, PROMPTS, ours_logits, prove, same_as_ours, stdlib_text, train

from yamlformer.builder.cli import main
from yamlformer.builder.gguf.llamacpp import NOT_BUILT, LlamaCpp, available

pytestmark = [pytest.mark.llamacpp, pytest.mark.skipif(not available(), reason=NOT_BUILT)]

#: the largest |logit difference| of an f32 file against our model (float32 both sides; the
#: orders of summation differ; measured up to 1.5e-4 on these models, logits up to ~3.5)
F32_TOLERANCE = 1e-3
#: --outtype's: its matrices rounded (measured on the trained llama: f16 4.8e-4, bf16 3.5e-3,
#: q8_0 6.6e-3; q8_0 on olmo2 1.1e-2)
TOLERANCES = {"f16": 5e-3, "bf16": 3e-2, "q8_0": 5e-2}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache) -> Path:
    return train(tmp_path_factory.mktemp("gguf-trained"), cache, LLAMA)


#: text that tests a tokenizer's edges: empty, spaces, newlines, indentation, bytes beyond ASCII
HARD = ["", " ", "\n\n\n", "        x", "naïve café ☃ 𝄞 日本語", "a\tb\r\nc"]


def _export(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "model.gguf"
    assert main(["export-gguf", *args, "-o", str(out)]) == 0
    return out


def test_a_trained_llama_runs_in_llama_cpp_as_ours(trained, tmp_path, capsys):
    gguf = _export(tmp_path, str(trained))
    capsys.readouterr()
    prove(trained, gguf, capsys, F32_TOLERANCE)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_runs_in_llama_cpp_as_ours(family, tmp_path, cache, capsys):
    spec, overrides = FAMILIES[family]
    checkpoint = train(tmp_path, cache, spec, overrides)
    gguf = _export(tmp_path, str(checkpoint), *EXPORT_ARGS.get(family, []))
    said = capsys.readouterr().out
    assert f"(from Hugging Face {family})" in said, said
    prove(checkpoint, gguf, capsys, F32_TOLERANCE)


def test_a_mistral_window_as_long_as_the_context_runs_in_llama_cpp_as_ours(tmp_path, cache, capsys):
    """A window of 128 over the 128-token context masks nothing: written as llama.cpp's llama
    (which has no window) without it; a shorter one is refused (tests/test_gguf_export.py)."""
    checkpoint = train(tmp_path, cache, "tiny/llama", {"decoder": {"attention": {"sliding_window": 128}}})
    gguf = _export(tmp_path, str(checkpoint))
    assert "llama.cpp llama (from Hugging Face mistral)" in capsys.readouterr().out
    prove(checkpoint, gguf, capsys, F32_TOLERANCE)


def test_llama4_chunks_and_temperature_past_8192_run_in_llama_cpp_as_ours(tmp_path):
    """Llama 4's chunks and NoPE temperature as llama.cpp fixes them (8192) over 8300 tokens
    (untrained, token ids in): past the first chunk llama.cpp's logits are ours, and those of
    the same weights with neither chunks nor temperature are not."""
    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.spec.loader import load_spec

    nope = {
        "rope": False,
        "chunk_size": None,
        "qk_norm": None,
        "temperature_tuning": {"floor_scale": 8192, "scale": 0.1},
    }
    stack = {
        "attention": {"chunk_size": 8192},
        "ffn": {"top_k": 2},
        "overrides": [{"layers": "3::4", "attention": nope}],
    }
    spec = {"extends": "tiny/llama4", "name": "long-llama4", "max_seq_len": 8320, "decoder": stack}
    path, plain_path = tmp_path / "spec.yaml", tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(spec))
    spec["decoder"]["attention"]["chunk_size"] = None
    spec["decoder"]["overrides"][0]["attention"]["temperature_tuning"] = None
    plain_path.write_text(yaml.safe_dump(spec))
    gguf = _export(tmp_path, str(path), "--init", "--seed", "0")
    torch.manual_seed(0)  # the weights --init --seed 0 drew
    model = build_model(load_spec(path)).eval()
    plain = build_model(load_spec(plain_path)).eval()
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (8300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ours, unchunked = (m(torch.tensor([ids]))[0, 8192:].float() for m in (model, plain))
    with LlamaCpp(gguf, n_ctx=8320) as runtime:
        theirs = torch.from_numpy(runtime.logits(ids)[8192:])
    assert (theirs - ours).abs().max().item() < F32_TOLERANCE
    assert (unchunked - ours).abs().amax(-1).min().item() > 10 * F32_TOLERANCE  # every position past 8192


@pytest.mark.parametrize("outtype", list(TOLERANCES))
def test_rounded_outtypes_run_alike_within_their_tolerance(outtype, trained, tmp_path, capsys):
    gguf = _export(tmp_path, str(trained), "--outtype", outtype)
    capsys.readouterr()
    prove(trained, gguf, capsys, TOLERANCES[outtype])


def test_an_imported_byte_level_tokenizer_runs_in_llama_cpp_as_ours(tmp_path, cache, capsys):
    """A GPT-2-style byte-level BPE tokenizer.json (what import-hf reads from most Hugging Face
    models), trained here, a model trained with it, and llama.cpp's gpt2 tokenizer on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from yamlformer.recipes.trained import load_trained

    folder = tmp_path / "tok"
    folder.mkdir()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(stdlib_text(300_000).split("\n"), trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    checkpoint = train(tmp_path, cache, LLAMA, tokenizer={"type": "hf", "model_file": str(folder)})
    gguf = _export(tmp_path, str(checkpoint))
    assert "byte-level BPE" in capsys.readouterr().out
    prove(checkpoint, gguf, capsys, F32_TOLERANCE, special=True)
    ours = load_trained(checkpoint, "cpu")[1]
    with LlamaCpp(gguf, n_ctx=128) as runtime:
        for text in HARD + ["it's 'll 'S I'M", "x  \n", "end   ", "\u00a0nbsp\u3000wide", "<|endoftext|>def"]:
            assert runtime.tokenize(text, special=True) == ours.encode(text), repr(text)


def test_llama3_rope_scaling_runs_in_llama_cpp_as_ours(tmp_path, cache, capsys):
    """Llama 3's scaled RoPE, written as llama.cpp's per-frequency factors (rope_freqs)."""
    scaling = {"type": "llama3", "factor": 8.0, "original_max_seq_len": 16, "low_freq_factor": 1.0}
    checkpoint = train(tmp_path, cache, LLAMA, {"position": {"type": "rope", "scaling": scaling}})
    gguf = _export(tmp_path, str(checkpoint))
    capsys.readouterr()
    import gguf as gguf_py

    assert "rope_freqs.weight" in {t.name for t in gguf_py.GGUFReader(str(gguf)).tensors}
    prove(checkpoint, gguf, capsys, F32_TOLERANCE)


#: YaRN as llama.cpp computes it: DeepSeek's (mscale equal to mscale_all_dim: cos and sin unscaled,
#: the temperature on every score; factor 40 over 4096) and GPT-OSS's with whole-dimension ramp
#: ends (factor 4 over 16; its own fractional ends are refused)
YARN = {
    "deepseek_v2": ("tiny/deepseek-v2", {"decoder": {"ffn": {"n_groups": 1, "topk_groups": 1}}}),
    "gpt_oss": ("tiny/gpt-oss", {"position": {"scaling": {"truncate": True}}}),
}


@pytest.mark.parametrize("family", list(YARN))
def test_yarn_runs_in_llama_cpp_as_ours(family, tmp_path, cache, capsys):
    spec, overrides = YARN[family]
    checkpoint = train(tmp_path, cache, spec, overrides)
    gguf = _export(tmp_path, str(checkpoint))
    assert f"(from Hugging Face {family})" in capsys.readouterr().out
    import gguf as gguf_py

    fields = gguf_py.GGUFReader(str(gguf)).fields
    assert any(k.endswith("rope.scaling.type") and f.contents() == "yarn" for k, f in fields.items())
    prove(checkpoint, gguf, capsys, F32_TOLERANCE)


def _adapted(tmp_path: Path, adapters: dict | None = None, **fields):
    """A spec with LoRA adapters (nonzero, as training leaves them; ``fields`` set on it), its
    model and its weights beside it (``model.safetensors``)."""
    from yamlformer.blocks.linear import adapter_parameters
    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.hf import save_weights
    from yamlformer.builder.spec.loader import load_spec

    adapters = adapters or {"type": "lora", "rank": 4, "alpha": 8, "targets": "all-linear"}
    spec = {**copy.deepcopy(LLAMA), "name": "adapted", "vocab_size": 400, "adapters": adapters, **fields}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    model = build_model(load_spec(path), init_seed=0).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    save_weights(model.state_dict(), tmp_path / "model.safetensors")
    return path, model


def test_a_model_with_adapters_merges_into_a_gguf_that_runs_alike(trained, tmp_path, capsys):
    """--merge: LoRA adapters folded into the weights; llama.cpp computes what our adapted model does."""
    from yamlformer.recipes.trained import load_trained

    path, model = _adapted(tmp_path)
    assert main(["export-gguf", str(path), "-o", str(tmp_path / "x.gguf")]) == 1
    assert "--merge" in capsys.readouterr().err
    gguf = _export(tmp_path, str(path), "--merge", "--tokenizer", str(trained))
    assert "adapters merged" in capsys.readouterr().out
    same_as_ours(model, load_trained(trained, "cpu")[1], gguf, F32_TOLERANCE)


#: the bases whose adapters are written alone (the attention fields on the trained llama's layout)
#: and the logit tolerance: Qwen 3's q/k norms on these untrained weights amplify rounding, its
#: --merge file of the same weights differing by as much (measured 1.9e-3 both): not the adapter
LORA_BASES = {
    "llama": ({}, F32_TOLERANCE),
    "qwen2": ({"qkv_bias": True}, F32_TOLERANCE),
    "qwen3": ({"qk_norm": {"type": "rmsnorm", "over": "head", "eps": 1e-5}}, 5e-3),
}


@pytest.mark.parametrize("family", list(LORA_BASES))
def test_adapters_alone_are_a_gguf_lora_llama_cpp_applies_over_the_base(family, trained, tmp_path, capsys):
    """--adapters-only (rsLoRA, so alpha is rescaled; every linear layer and an untied head): a GGUF
    LoRA adapter; llama.cpp with the base's GGUF and it computes what our adapted model does, the
    base alone does not."""
    from yamlformer.builder.hf import save_weights
    from yamlformer.recipes.trained import load_trained

    adapters = {"type": "lora", "rank": 4, "alpha": 8, "rank_scaled": True, "targets": ["decoder", "head"]}
    decoder = copy.deepcopy(LLAMA["decoder"])
    fields, tolerance = LORA_BASES[family]
    decoder["attention"].update(fields)
    path, model = _adapted(tmp_path, adapters, tie_embeddings=False, decoder=decoder)
    base = yaml.safe_load(path.read_text())
    del base["adapters"]
    (tmp_path / "base").mkdir()
    base_path = tmp_path / "base" / "spec.yaml"
    base_path.write_text(yaml.safe_dump(base))
    state = {k: v for k, v in model.state_dict().items() if ".adapter." not in k}
    save_weights(state, tmp_path / "base" / "model.safetensors")
    base_gguf = tmp_path / "base.gguf"
    assert main(["export-gguf", str(base_path), "--tokenizer", str(trained), "-o", str(base_gguf)]) == 0
    adapter = tmp_path / "adapter.gguf"
    assert main(["export-gguf", str(path), "--adapters-only", "-o", str(adapter)]) == 0
    assert "adapters alone" in capsys.readouterr().out
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(str(adapter))
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    assert reader.fields["general.architecture"].contents() == family
    assert reader.fields["adapter.lora.alpha"].contents() == pytest.approx(16.0)  # 8 / sqrt(4) = 16 / 4
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_q.weight.lora_a", "blk.1.ffn_down.weight.lora_b", "output.weight.lora_b"} <= names
    tokenizer = load_trained(trained, "cpu")[1]
    same_as_ours(model, tokenizer, base_gguf, tolerance, lora=adapter)
    with LlamaCpp(base_gguf, n_ctx=model.spec.max_seq_len) as runtime:  # the base alone computes another model
        ids = tokenizer.encode(PROMPTS[0])
        theirs = torch.from_numpy(runtime.logits(ids)[-1])
    assert (theirs - ours_logits(model, ids)[: runtime.n_vocab]).abs().max().item() > 100 * F32_TOLERANCE


def test_llama_cpp_reads_our_tokenizer_on_hard_text(trained, tmp_path, capsys):
    """Byte fallback, runs of spaces and newlines, a control piece typed as text, no prefix space."""
    from yamlformer.recipes.trained import load_trained

    gguf = _export(tmp_path, str(trained))
    _, tokenizer, _ = load_trained(trained, "cpu")
    with LlamaCpp(gguf, n_ctx=96) as runtime:
        for text in [*HARD, "</s>def</s>", "<0x41>"]:
            assert runtime.tokenize(text) == tokenizer.encode(text), repr(text)


def test_a_spec_exports_untrained_and_runs_alike(trained, tmp_path, capsys):
    """--init: random weights drawn from the spec's initialization, with a checkpoint's tokenizer."""
    spec = {**copy.deepcopy(LLAMA), "name": "untrained", "vocab_size": 400, "tie_embeddings": False}
    spec["decoder"]["attention"] = {"n_heads": 8, "n_kv_heads": 1}  # multi-query
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    gguf = _export(tmp_path, str(path), "--init", "--seed", "3", "--tokenizer", str(trained))
    assert "random weights (--init, seed 3): untrained" in capsys.readouterr().out
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(str(gguf))
    assert reader.fields["general.description"].contents() == "random weights (--init, seed 3): untrained"
    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.spec.loader import load_spec
    from yamlformer.recipes.trained import load_trained

    torch.manual_seed(3)  # the weights --init --seed 3 drew
    model = build_model(load_spec(path)).eval()
    same_as_ours(model, load_trained(trained, "cpu")[1], gguf, F32_TOLERANCE)
