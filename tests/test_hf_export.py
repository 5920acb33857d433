"""Export's reach and its refusals: a spec without biases written by a family with them (zeros),
BERT's sequence classifier, the zoo's translation spec as Pegasus, the special tokens a client is
told, and a spec no family expresses refused in one line before any weights are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from yamlformer.builder.assemble import build_model
from yamlformer.builder.cli import main
from yamlformer.builder.hf import from_hf, to_hf
from yamlformer.builder.spec.loader import load_spec

REPO = Path(__file__).resolve().parents[1]


def _unit_scale(model) -> None:
    """Weights at unit scale, so logits are O(1) and a 1e-4 tolerance means something."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen) if "norm" in name else 0.2 * torch.randn(p.shape))


def _ids(vocab: int, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(3))


def test_a_spec_without_biases_exports_as_gpt2_with_zero_biases(tmp_path):
    """nanoGPT's bias-free layout (shakespeare-char's spec) is GPT-2 with every bias zero: the
    same logits; the folder imports back with the biases, all zero."""
    import yaml

    recipe = yaml.safe_load((REPO / "recipes" / "shakespeare-char.yaml").read_text())
    spec = load_spec(recipe["model"]["spec"] | {"vocab_size": 66}, overrides={"d_model": 32, "decoder.n_layers": 2})
    model = build_model(spec).eval()
    _unit_scale(model)
    assert to_hf(spec, model, tmp_path / "out").model_type == "gpt2"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = _ids(66)
    with torch.no_grad():
        assert (theirs(ids).logits - model(ids)).abs().max().item() < 1e-4
    back, state = from_hf(tmp_path / "out")
    assert back.decoder.attention.qkv_bias and back.decoder.norm.bias
    assert all(not t.any() for name, t in state.items() if name.endswith(".bias"))


def test_a_family_that_fits_exactly_wins_over_one_that_needs_zero_biases():
    from yamlformer.builder.hf import choose_family

    assert choose_family(load_spec(REPO / "specs" / "tiny" / "llama.yaml"))[0].model_type == "llama"


def test_berts_sequence_classifier_round_trips(tmp_path):
    """`head: {type: classification, pooler: true}` is BertForSequenceClassification, labels named."""
    spec = load_spec(
        REPO / "specs" / "tiny" / "bert.yaml",
        overrides={"head": {"type": "classification", "n_classes": 3, "pooler": True}},
    )
    model = build_model(spec).eval()
    _unit_scale(model)
    family = to_hf(spec, model, tmp_path / "out", extra_config={"id2label": {0: "a", 1: "b", 2: "c"}})
    assert (family.hf_class, family.auto_class) == (
        "BertForSequenceClassification",
        "AutoModelForSequenceClassification",
    )
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert theirs.config.id2label == {0: "a", 1: "b", 2: "c"}
    ids = _ids(spec.vocab_size)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        assert (theirs(input_ids=ids, attention_mask=mask).logits - model(ids, mask)).abs().max().item() < 1e-4
    back, _ = from_hf(tmp_path / "out")
    assert back.model_dump(exclude={"name"}) == spec.model_dump(exclude={"name"})
    unpooled = load_spec(REPO / "specs" / "tiny" / "bert.yaml", overrides={"head": {"type": "classification"}})
    from yamlformer.builder.hf import export_line

    assert "head.pooler is False in the spec; bert would make it True" in export_line(unpooled)


def test_the_zoo_translation_spec_is_pegasus(tmp_path):
    spec = load_spec(
        REPO / "specs" / "transformer-multi30k.yaml",
        overrides={"vocab_size": 90, "d_model": 32, "encoder.n_layers": 1, "decoder.n_layers": 1},
    )
    model = build_model(spec).eval()
    _unit_scale(model)
    tokens = {"pad_token_id": 0, "eos_token_id": 3, "decoder_start_token_id": 2}
    assert to_hf(spec, model, tmp_path / "out", extra_config=tokens).model_type == "pegasus"
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out").eval()
    src, tgt = _ids(90), _ids(90, (2, 7))
    with torch.no_grad():
        hf = theirs(input_ids=src, decoder_input_ids=tgt).logits
        assert hf.std() > 0.1 and (hf - model(src, decoder_input_ids=tgt)).abs().max().item() < 1e-4
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["normalize_before"] is True and config["normalize_embedding"] is False  # CTranslate2 reads them


def test_a_spec_no_family_expresses_is_one_line_before_any_weights_are_read(tmp_path, capsys):
    """No weights beside the spec: the refusal comes first, naming the nearest family and field."""
    assert main(["export-hf", str(REPO / "specs" / "transformer-base.yaml"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: no Hugging Face family expresses spec 'transformer-base' exactly; nearest, marian: "
        "position.layout is 'interleaved' in the spec; marian would make it 'split' (and 12 more)"
    )
    assert not (tmp_path / "out").exists()
    tiny = str(REPO / "specs" / "tiny" / "transformer.yaml")
    assert main(["export-hf", tiny, "-o", str(tmp_path / "out"), "--family", "pegasus"]) == 1
    assert capsys.readouterr().err.startswith(
        "error: family 'pegasus' does not express spec 'tiny-transformer' exactly: position.layout"
    )
    assert main(["export-hf", tiny, "-o", str(tmp_path / "out"), "--family", "gpt2"]) == 1
    assert capsys.readouterr().err.strip() == "error: spec 'tiny-transformer' is encoder-decoder; gpt2 is decoder-only"


def test_the_special_tokens_a_client_is_told(tmp_path):
    """An LM's end-of-text token is its bos and unk too; an encoder's text is [CLS] ... [SEP] with
    [MASK] named; Pegasus's pad is the decoder's start; a recipe's char table ends in U+0003."""
    import sentencepiece as spm

    from yamlformer.builder.hf.tokenizer import CHAR_EOS, client_specials, write_tokenizer
    from yamlformer.recipes.data.tokenizers import CharTokenizer

    char = CharTokenizer.fit("abc\nd", eos=True)
    assert char.chars[-1] == CHAR_EOS and char.eos_id == 5 and char.decode([1, 5, 2]) == "ab"
    assert CharTokenizer.fit("abc").eos_id is None  # a table made without one
    lm = client_specials(char.state(), "decoder-only")
    assert lm == dict.fromkeys(("eos_token", "bos_token", "unk_token"), (CHAR_EOS, 5))

    def trained(**ids) -> dict:
        import io

        buffer = io.BytesIO()
        text = ["the cat sat on the mat", "a dog ran in the park"] * 50
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(text),
            model_writer=buffer,
            vocab_size=30,
            hard_vocab_limit=False,
            minloglevel=2,
            **ids,
        )
        return {"type": "sentencepiece", "model_proto": buffer.getvalue()}

    bert = trained(pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="[PAD]", unk_piece="[UNK]", bos_piece="[CLS]",
                   eos_piece="[SEP]", control_symbols="[MASK]")  # fmt: skip
    write_tokenizer(bert, tmp_path / "bert", 32, "encoder-only")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "bert")
    ids = tok("the cat")["input_ids"]
    assert ids[0] == tok.cls_token_id == 2 and ids[-1] == tok.sep_token_id == 3 and tok.mask_token == "[MASK]"
    assert "token_type_ids" in tok("the cat")

    mt = trained(pad_id=0, unk_id=1, bos_id=2, eos_id=3)
    assert client_specials(mt, "encoder-decoder", start_from_pad=True)["pad_token"] == ("<s>", 2)
    write_tokenizer(mt, tmp_path / "mt", 32, "encoder-decoder", start_from_pad=True)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "mt")
    assert tok("the cat")["input_ids"][-1] == tok.eos_token_id == 3 and "token_type_ids" not in tok("the cat")


def test_list_has_each_zoo_entrys_export_family():
    from yamlformer.builder.cli.list import rows

    exports = {row["name"]: row["export"] for row in rows()}
    assert exports["translate-multi30k"] == exports["transformer-multi30k"] == "pegasus"
    assert exports["shakespeare-char"] == "gpt2" and exports["lm-stdlib"] == "llama"
    assert exports["bert-mlm"] == exports["classify"] == "bert" and exports["transformer-base"] is None
