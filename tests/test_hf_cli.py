"""Hugging Face interop beyond the parity cases of tests/test_hf.py: the command line, other
on-disk layouts (sharded, fused experts), a training checkpoint's export, and the errors a bad
folder or an unexportable spec gets. Models are built from tests/test_hf.py's small configs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from test_hf import CASES, REPO, _batch, _logits, _randomize

from yamlformer.builder.assemble import build_model
from yamlformer.builder.hf import HFError, from_hf, load_weights
from yamlformer.builder.spec.loader import load_spec

# --- the command line, other on-disk layouts, and errors ---------------------------------


def _saved(case_name: str, folder: Path, **save_kwargs):
    torch.manual_seed(0)
    model = CASES[case_name].make()
    _randomize(model)
    model.save_pretrained(folder, **save_kwargs)
    return model.eval()


def test_cli_import_then_export_loads_in_transformers(tmp_path, capsys):
    from yamlformer.builder.cli import main

    hf = _saved("gpt2", tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "ours")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["export-hf", str(tmp_path / "ours" / "spec.yaml"), "-o", str(tmp_path / "back")]) == 0
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    inputs = _batch("causal")
    assert torch.equal(_logits(again, inputs, ours=False), _logits(hf, inputs, ours=False))


def test_unsupported_model_type_lists_the_families_and_exits_1(tmp_path, capsys):
    from yamlformer.builder.cli import main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    assert main(["import-hf", str(tmp_path / "m"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "'bloom' is not supported" in err and "llama" in err and "marian" in err
    assert "Traceback" not in err


def test_sharded_checkpoint_reads_like_a_single_file(tmp_path):
    _saved("llama3", tmp_path / "one")
    _saved("llama3", tmp_path / "shards", max_shard_size="20KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    _, single = from_hf(tmp_path / "one")
    _, sharded = from_hf(tmp_path / "shards")
    assert set(single) == set(sharded) and all(torch.equal(single[k], sharded[k]) for k in single)


def test_mixtral_fused_expert_layout_imports_too(tmp_path):
    """transformers 5.x holds experts as 3-D gate_up_proj/down_proj; a state dict saved as-is."""
    from safetensors.torch import save_file

    hf = _saved("mixtral", tmp_path / "legacy")
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "legacy" / "config.json").read_text())
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    _, legacy_state = from_hf(tmp_path / "legacy")
    _, fused_state = from_hf(tmp_path / "fused")
    assert set(legacy_state) == set(fused_state)
    assert all(torch.equal(legacy_state[k], fused_state[k]) for k in legacy_state)


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
    _saved("llama3", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["intermediate_size"] = 80  # the checkpoint holds 96
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\(96, 64\).*\(80, 64\)"):
        from_hf(tmp_path / "hf")

    spec, state = from_hf(_fresh(tmp_path))
    model = build_model(spec)
    state["decoder.final_norm.weight"] = torch.ones(7)
    with pytest.raises(
        HFError, match=r"decoder\.final_norm\.weight: the weights have shape \(7,\), the model has \(64,\)"
    ):
        load_weights(model, state)


def _fresh(tmp_path: Path) -> Path:
    _saved("llama3", tmp_path / "fresh")
    return tmp_path / "fresh"


def test_export_says_why_a_spec_has_no_hugging_face_family(tmp_path, capsys):
    import yaml

    from yamlformer.builder.cli import main

    spec = {
        "name": "alibi-lm",
        "architecture": "decoder-only",
        "vocab_size": 64,
        "d_model": 32,
        "max_seq_len": 16,
        "position": {"type": "alibi"},
        "decoder": {"n_layers": 1, "attention": {"n_heads": 4}, "norm": {"type": "rmsnorm"}},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    from yamlformer.builder.hf import save_weights

    save_weights(build_model(load_spec(tmp_path / "spec.yaml")), tmp_path / "model.safetensors")
    assert main(["export-hf", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no Hugging Face family expresses spec 'alibi-lm' exactly; nearest, ")
    assert "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_export_from_a_training_checkpoint(tmp_path):
    """The layout `builder train` writes: {"builder": {"spec": ...}, "state_dict": {"model.<name>": ...}}."""
    hf = _saved("qwen2", tmp_path / "hf")
    spec, state = from_hf(tmp_path / "hf")
    model = load_weights(build_model(spec), state)
    ckpt = {
        "builder": {"spec": spec.model_dump(mode="json")},
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
    }
    torch.save(ckpt, tmp_path / "last.ckpt")
    from yamlformer.builder.cli import main

    assert main(["export-hf", str(tmp_path / "last.ckpt"), "-o", str(tmp_path / "out")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    inputs = _batch("causal")
    assert torch.equal(_logits(again, inputs, ours=False), _logits(hf, inputs, ours=False))


def test_gemma_embedding_scale_is_rounded_to_the_model_dtype(tmp_path):
    """Gemma multiplies by sqrt(d_model) as a bf16 number (5.657 -> 5.65625 at d_model 32);
    the imported spec says so (embedding.scale_in_model_dtype) and the bf16 model does it."""
    hf = _saved("gemma", tmp_path / "hf").to(torch.bfloat16)
    spec, state = from_hf(tmp_path / "hf")
    assert spec.embedding.scale_in_model_dtype
    ours = load_weights(build_model(spec, dtype=torch.bfloat16), state)
    ids = _batch("causal")["input_ids"]
    with torch.no_grad():
        theirs = hf.model.embed_tokens(ids)  # GemmaTextScaledWordEmbedding: the table times the bf16 factor
        mine = ours.decoder.embedding(ids)
        exact = hf.model.embed_tokens.weight[ids] * 32**0.5
    assert torch.equal(mine, theirs) and not torch.equal(mine, exact)


def test_zoo_gemma2_is_exported_as_gemma2_by_default():
    """specs/tiny/gemma2.yaml (the zoo's Gemma 2 fields: softcaps, sandwich norms, windows on even
    layers) is written as Gemma 2 without naming the family (its logits: test_hf_families_zoo.py)."""
    from yamlformer.builder.hf import choose_family

    family, _ = choose_family(load_spec(REPO / "specs" / "tiny" / "gemma2.yaml"))
    assert family.model_type == "gemma2"


def test_describe_says_before_training_which_family_a_spec_exports_to_or_why_none(capsys):
    from yamlformer.builder.cli import main

    assert main(["describe", "llama3-8b"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "export: Hugging Face llama (LlamaForCausalLM), by builder export-hf"
    )
    assert main(["describe", "mpt-7b"]) == 0  # ALiBi
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "export: Hugging Face mpt (MptForCausalLM), by builder export-hf"
    )
    assert main(["describe", "pythia-160m"]) == 0  # GPT-NeoX's parallel residual
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "export: Hugging Face gpt_neox (GPTNeoXForCausalLM), by builder export-hf"
    )
    assert main(["describe", "transformer-base"]) == 0  # interleaved sinusoids: no family
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("export: none: no Hugging Face family expresses it exactly (closest, marian: ")
