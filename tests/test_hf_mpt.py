"""The ``mpt`` family beyond the parity cases every family has in ``tests/test_hf.py`` (import
from a random tiny ``MptForCausalLM`` with 4 and 6 heads: logits, greedy tokens, count, export
and back): ALiBi slopes equal to MPT's for every head count, the zoo's MPT spec written for
transformers and counted by it, the config values refused and why, the spec fields export
names, cached decoding of an imported model, and the export line before training.

The refusals need no ``transformers``: their folders are written by our own exporter from
``specs/tiny/alibi.yaml``, then edited.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from yamlformer.builder.analysis.estimates import estimate
from yamlformer.builder.assemble import build_model
from yamlformer.builder.cli import main
from yamlformer.builder.hf import FAMILIES, fit, from_hf, load_weights, to_hf
from yamlformer.builder.spec.loader import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "specs" / "tiny" / "alibi.yaml"


def _unit_scale(model) -> None:
    """Weights at unit scale so logits are O(1) and a 1e-4 tolerance means something."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
                if p.dim() >= 2
                else 0.5 + torch.rand(p.shape, generator=gen)
            )


def _padded_batch(vocab: int, length: int = 24):
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, length - 5 :] = 0
    return ids, mask


# --- ALiBi slopes, and the zoo spec in transformers ----------------------------------------


def test_alibi_slopes_are_mpt_s_for_every_head_count():
    """MPT spreads 2^(-8k/n') over the next power of two n' and, for other counts, takes the odd
    members first; the project's slopes (the ALiBi paper's) are the same numbers in the same order."""
    build_mpt_alibi_tensor = pytest.importorskip("transformers.models.mpt.modeling_mpt").build_mpt_alibi_tensor
    from yamlformer.blocks.positions import alibi_slopes

    for n_heads in range(1, 65):
        bias = build_mpt_alibi_tensor(n_heads, 2)  # (heads, 1, 2): slope * (key - last key)
        torch.testing.assert_close(alibi_slopes(n_heads), -bias[:, 0, 0], rtol=1e-6, atol=0, msg=f"{n_heads} heads")


def test_zoo_tiny_mpt_exports_as_mpt_with_the_same_logits_and_tokens(tmp_path):
    """specs/tiny/alibi.yaml (the zoo's MPT-7B shrunk) is written as MptForCausalLM, and
    transformers computes our logits from it on a right-padded batch, and decodes our tokens."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    spec = load_spec(TINY)
    torch.manual_seed(0)
    ours = build_model(spec).eval()
    _unit_scale(ours)
    assert to_hf(spec, ours, tmp_path / "out").model_type == "mpt"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["MptForCausalLM"] and config["attn_config"]["alibi_bias_max"] == 8
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids, mask = _padded_batch(spec.vocab_size)
    with torch.no_grad():
        mine, hf_logits = ours(ids, attention_mask=mask), theirs(input_ids=ids, attention_mask=mask).logits
    kept = mask == 1
    assert hf_logits[kept].std() > 0.1
    assert (mine[kept] - hf_logits[kept]).abs().max().item() < 1e-4
    prompt = ids[:, :5]
    hf_tokens = theirs.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        num_beams=1,
        max_new_tokens=8,
        min_new_tokens=8,
        pad_token_id=0,
    )
    assert torch.equal(ours.generate(prompt, max_new_tokens=8), hf_tokens)


def test_zoo_mpt_7b_counts_what_transformers_builds_on_meta():
    transformers = pytest.importorskip("transformers")
    spec = load_spec(REPO / "specs" / "mpt-7b.yaml")
    config = FAMILIES["mpt"].to_config(spec)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("mpt", **config))
    assert sum(p.numel() for p in model.parameters()) == estimate(spec).params.total == 6_649_286_656


def test_export_then_import_gives_the_spec_and_the_weights_back(tmp_path):
    spec = load_spec(TINY)
    torch.manual_seed(0)
    ours = build_model(spec)
    to_hf(spec, ours, tmp_path / "out")
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "transformer.blocks.1.attn.Wqkv.weight" in names and "lm_head.weight" not in names  # fused, tied
    back, state = from_hf(tmp_path / "out")
    assert back.model_dump(exclude={"name"}) == spec.model_dump(exclude={"name"})
    mine = ours.state_dict()
    assert set(state) == {k for k in mine if k != "head.proj.weight"}  # the head is the embedding
    assert all(torch.equal(state[k], mine[k]) for k in state)


# --- cached decoding of an imported model --------------------------------------------------


def test_imported_six_head_model_decodes_from_its_cache_as_from_scratch(tmp_path):
    """Six heads (MPT's non-power-of-two slopes), a softmax_scale: cached greedy decoding equals
    decoding without a cache, and each cached step's logits equal the full forward's."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from yamlformer.blocks.generation import KVCache

    torch.manual_seed(0)
    hf = transformers.MptForCausalLM(
        transformers.MptConfig(
            d_model=48,
            n_heads=6,
            n_layers=2,
            vocab_size=128,
            max_seq_len=64,
            attn_config={"softmax_scale": 0.2},
        )
    )
    _unit_scale(hf)
    hf.save_pretrained(tmp_path / "hf")
    spec, state = from_hf(tmp_path / "hf")
    assert spec.decoder.attention.n_heads == 6 and spec.decoder.attention.scale == 0.2
    model = load_weights(build_model(spec), state).eval()
    ids, _ = _padded_batch(spec.vocab_size, length=20)
    cached = model.generate(ids[:, :5], max_new_tokens=30)
    assert torch.equal(cached, model.generate(ids[:, :5], max_new_tokens=30, use_cache=False))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_stack(model.decoder, 2, 20, torch.float32, "cpu")
        parts = [model(ids[:, :6], cache=cache)] + [model(ids[:, i : i + 1], cache=cache) for i in range(6, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)


# --- what import refuses, and what export names --------------------------------------------


@pytest.fixture
def mpt_folder(tmp_path) -> Path:
    spec = load_spec(TINY)
    torch.manual_seed(0)
    to_hf(spec, build_model(spec), tmp_path / "hf")
    return tmp_path / "hf"


def _edit(folder: Path, attn: dict | None = None, **values) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(values)
    config["attn_config"].update(attn or {})
    (folder / "config.json").write_text(json.dumps(config))


def _refused(folder: Path, capsys, *needles: str) -> str:
    assert main(["import-hf", str(folder), "-o", str(folder.parent / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"
    return err


def test_the_undamaged_mpt_folder_imports(mpt_folder, tmp_path):
    assert main(["import-hf", str(mpt_folder), "-o", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize(
    "attn, values, needles",
    [
        ({"alibi": False}, {}, ("attn_config.alibi false", "applies ALiBi")),
        ({"alibi_bias_max": 16}, {}, ("alibi_bias_max 16", "with 8")),
        ({"attn_type": "multiquery_attention"}, {}, ("attn_type", "3 * d_model")),
        ({"clip_qkv": 6.0}, {}, ("clip_qkv 6.0", "no counterpart")),
        ({"qk_ln": True}, {}, ("qk_ln true", "ignores it")),
        ({"prefix_lm": True}, {}, ("prefix_lm true", "ignores it")),
        ({}, {"no_bias": False}, ("no_bias false", "no biases")),
        ({}, {"expansion_ratio": 2}, ("expansion_ratio 2", "4 * d_model")),
        ({}, {"logit_scale": 0.5}, ("logit_scale", "ignores it")),
        ({}, {"logit_scale": "inv_sqrt_d_model"}, ("logit_scale", "ignores it")),
        ({}, {"embedding_fraction": 0.1}, ("embedding_fraction 0.1", "no counterpart")),
        ({}, {"norm_type": "low_precision_rmsnorm"}, ("norm_type", "LayerNorm")),
    ],
)
def test_a_config_transformers_computes_otherwise_is_refused_naming_the_key(mpt_folder, capsys, attn, values, needles):
    _edit(mpt_folder, attn, **values)
    err = _refused(mpt_folder, capsys, "config.json", "mpt:", *needles)
    assert "inv_sqrt" not in err and "rmsnorm" not in err  # a config's text is never printed


def test_what_only_training_or_implementation_reads_is_accepted(mpt_folder, tmp_path):
    """learned_pos_emb (ignored with ALiBi, by MosaicML's code too), attn_uses_sequence_id (packed
    documents in training: data.packing doc_masked here), attn_impl, and MPT's spellings."""
    _edit(
        mpt_folder,
        {"attn_uses_sequence_id": True, "attn_impl": "triton", "clip_qkv": None},
        learned_pos_emb=True,
        norm_type="layernorm",
        init_device="meta",
    )
    spec, _ = from_hf(mpt_folder)
    assert spec.position.type == "alibi" and spec.decoder.norm.type == "layernorm"


@pytest.mark.parametrize(
    "attn, values, needle",
    [
        ({"alibi": "yes"}, {}, "attn_config.alibi: expected true or false"),
        ({"softmax_scale": "big"}, {}, "attn_config.softmax_scale: expected a finite number"),
        ({}, {"attn_config": [1]}, "attn_config: expected a mapping or null"),
        ({}, {"n_heads": 0}, "n_heads: expected an integer from 1"),
    ],
)
def test_a_value_of_the_wrong_kind_names_its_key(mpt_folder, capsys, attn, values, needle):
    config = json.loads((mpt_folder / "config.json").read_text())
    config["attn_config"].update(attn)
    config.update(values)
    (mpt_folder / "config.json").write_text(json.dumps(config))
    _refused(mpt_folder, capsys, "config.json", needle)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"decoder.ffn.hidden_dim": 128}, "ffn.hidden_dim is 128 in the spec; mpt would make it 256"),
        ({"decoder.ffn.activation": "gelu_tanh"}, "ffn.activation is 'gelu_tanh' in the spec; mpt would make it"),
        ({"decoder.norm.bias": True}, "norm.bias is True in the spec; mpt would make it False"),
        ({"decoder.attention.qkv_bias": True}, "attention.qkv_bias is True"),
        ({"decoder.attention.n_kv_heads": 2}, "attention.n_kv_heads is 2"),
        ({"decoder.norm.placement": "post"}, "norm.placement is 'post'"),
        ({"position": {"type": "rope"}}, "position.type is 'rope'; mpt uses alibi"),
    ],
)
def test_export_names_the_spec_field_mpt_cannot_express(change, needle):
    data = load_spec(TINY).model_dump(mode="json")
    for dotted, value in change.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    from yamlformer.builder.hf import validate

    config, reasons = fit(FAMILIES["mpt"], validate(data))
    assert config is None and any(needle in reason for reason in reasons), reasons


def test_the_export_line_names_mpt_before_training(capsys, tmp_path, monkeypatch):
    """builder describe and train --dry-run say, before any training, that MPT exports."""
    monkeypatch.chdir(tmp_path)
    assert main(["describe", "tiny/alibi"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "export: Hugging Face mpt (MptForCausalLM), by builder export-hf"
    )
    assert main(["train", "shakespeare-char", "--dry-run", "--set", "model.spec=mpt-7b"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("export ")]
    assert lines and lines[0].split(None, 1)[1] == "Hugging Face mpt (MptForCausalLM), by builder export-hf"
