"""Tokenizers through Hugging Face folders: a tiny LM trained by a recipe (char and sentencepiece
BPE), exported with its tokenizer, generates in ``transformers.pipeline`` exactly what ``builder
generate`` does; ``AutoTokenizer`` encodes as ours does; a unigram model converts with ties
only; an imported folder's tokenizer drives ``builder generate`` and a recipe."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from recipe_helpers import tiny_recipe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from yamlformer.builder.cli import main
from yamlformer.builder.hf.tokenizer import from_sentencepiece, read_tokenizer, to_tokenizers, token_ids

#: whitespace runs, tabs, newlines, accents, CJK, an emoji, a non-breaking space, sentencepiece's
#: own space mark, and text that spells special pieces
VARIED = (
    "def  parse(x):\n\t\treturn   x**2  # ünïcødé ✓ 漢字 \U0001f600\n\n\n    if a\u00a0b:"
    "  \u2581 pass\r\n<unk> <s> </s>"
)
PROMPT = "def parse("


def _stdlib_text(limit: int = 60_000) -> str:
    from yamlformer.recipes.data.corpus import read_corpus
    from yamlformer.recipes.recipe.sections import DataSection

    return read_corpus(DataSection(sources=["python-stdlib"], max_bytes=limit), None).text


@pytest.fixture(scope="module", params=["char", "bpe"])
def exported(request, tmp_path_factory):
    """A tiny LM trained a few steps by a recipe, and its `builder export-hf` folder."""
    from yamlformer.recipes.training.run import run

    tmp = tmp_path_factory.mktemp(f"export-{request.param}")
    tokenizer = (
        {"type": "char"}
        if request.param == "char"
        else {"type": "sentencepiece", "model_type": "bpe", "vocab_size": 400}
    )
    path = tiny_recipe(
        tmp, tokenizer=tokenizer, trainer={"max_steps": 8, "val_check_interval": 8, "checkpoint_every_n_steps": 8}
    )
    summary = run(path, samples=False)
    assert main(["export-hf", summary["last"], "-o", str(tmp / "hf")]) == 0
    return request.param, Path(summary["last"]), tmp / "hf"


def _ours(checkpoint: Path | str, capsys, prompt: str = PROMPT, new: int = 16) -> str:
    assert (
        main(["generate", str(checkpoint), "--prompt", prompt, "--max-new-tokens", str(new), "--temperature", "0"]) == 0
    )
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def test_pipeline_generates_what_builder_generate_does(exported, capsys):
    """Greedy text and tokens within the context (past it, ours slides the window), and the
    logits of a window of the corpus: a barely trained model repeats itself, the logits do not."""
    from yamlformer.recipes.trained import load_trained

    kind, checkpoint, folder = exported
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    pipe = transformers.pipeline("text-generation", model=str(folder), device="cpu")
    model, tokenizer, meta = load_trained(checkpoint, "cpu")
    context = meta["spec"]["max_seq_len"]
    for prompt in (PROMPT, "import os\n\nclass A:\n    "):
        ids = tokenizer.encode(prompt)
        new = context - len(ids)
        theirs = pipe(prompt, max_new_tokens=new, do_sample=False)[0]["generated_text"]
        assert theirs == _ours(checkpoint, capsys, prompt, new), kind
        tokens = pipe(prompt, max_new_tokens=new, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
        assert list(tokens) == model.generate(torch.tensor([ids]), max_new_tokens=new)[0].tolist()

    window = torch.tensor([tokenizer.encode(_stdlib_text(5_000))[:context]])  # (1, context)
    with torch.no_grad():
        mine, hf_logits = model(window), pipe.model(window).logits
    assert hf_logits.std() > 0.1 and (mine - hf_logits).abs().max() < 1e-4


def test_auto_tokenizer_encodes_as_ours(exported):
    from yamlformer.recipes.trained import load_trained

    kind, checkpoint, folder = exported
    _, ours, meta = load_trained(checkpoint, "cpu")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    if kind == "char":  # ours refuses a character outside its vocabulary; Hugging Face's drops it
        known = "".join(c for c in VARIED if c in ours.index)
        assert len(known) < len(VARIED)
        assert theirs(known)["input_ids"] == ours.encode(known)
        assert theirs(VARIED)["input_ids"] == ours.encode(known)
        text = known
    else:
        assert theirs(VARIED)["input_ids"] == ours.encode(VARIED)
        assert any(
            theirs.convert_ids_to_tokens(theirs(VARIED)["input_ids"])[i].startswith("<0x")
            for i in range(len(theirs(VARIED)["input_ids"]))
        ), "no byte fallback exercised"
        text = VARIED
    sample = _stdlib_text(20_000)
    assert theirs(sample)["input_ids"] == ours.encode(sample)
    ids = ours.encode(text)
    assert theirs.decode(ids) == ours.decode(ids) == text.replace("\u2581", " ")  # sentencepiece's space mark
    config = json.loads((folder / "generation_config.json").read_text())
    assert "max_length" not in config  # generate(max_new_tokens=...) would warn that both are set
    assert json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"] == meta["spec"]["max_seq_len"]
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~_umask()  # not safetensors' 0600


def test_the_folder_says_what_llama_cpps_converter_reads(exported):
    """convert_hf_to_gguf.py reads a sentencepiece model only from tokenizer.model, whether a BOS
    or EOS is added from add_bos_token/add_eos_token, and a space put first from add_prefix_space
    (tests/test_gguf_convert.py runs it): nothing is added to a language model's text, and no space."""
    from sentencepiece import SentencePieceProcessor

    from yamlformer.recipes.trained import load_trained

    kind, checkpoint, folder = exported
    _, ours, meta = load_trained(checkpoint, "cpu")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (config["add_bos_token"], config["add_eos_token"]) == (False, False)
    if kind == "char":
        assert not (folder / "tokenizer.model").exists() and "add_prefix_space" not in config
        return
    assert (folder / "tokenizer.model").read_bytes() == bytes(meta["tokenizer"]["model_proto"])
    model = SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert model.encode(VARIED) == ours.encode(VARIED)
    assert config["add_prefix_space"] is False  # the recipes' sentencepiece puts no dummy prefix


def test_an_exported_folder_imports_with_its_tokenizer_and_generates_alike(exported, tmp_path, capsys):
    _, checkpoint, folder = exported
    expected = _ours(checkpoint, capsys)
    assert main(["import-hf", str(folder), "-o", str(tmp_path / "ours")]) == 0
    capsys.readouterr()
    assert read_tokenizer(tmp_path / "ours")["type"] == "tokenizers"
    assert _ours(tmp_path / "ours", capsys) == expected  # an import-hf output
    assert _ours(folder, capsys) == expected  # the Hugging Face folder itself


def test_a_recipe_trains_with_a_folders_tokenizer_and_exports_it_again(exported, tmp_path, capsys):
    from yamlformer.recipes.training.run import run

    kind, _, folder = exported
    path = tiny_recipe(
        tmp_path,
        tokenizer={"type": "hf", "model_file": str(folder)},
        trainer={"max_steps": 2, "val_check_interval": 2, "checkpoint_every_n_steps": 2},
    )
    summary = run(path, samples=False)
    meta = torch.load(summary["last"], map_location="cpu", weights_only=True)["builder"]
    assert meta["tokenizer"]["type"] == "tokenizers"
    assert meta["spec"]["vocab_size"] == to_tokenizers(read_tokenizer(folder)).get_vocab_size()
    capsys.readouterr()
    text = _ours(summary["last"], capsys)
    assert text.startswith(PROMPT)
    assert main(["export-hf", summary["last"], "-o", str(tmp_path / "again")]) == 0
    capsys.readouterr()
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
    original = transformers.AutoTokenizer.from_pretrained(folder)
    sample = _stdlib_text(5_000)
    assert again(sample)["input_ids"] == original(sample)["input_ids"]


def _spm(model_type: str, vocab_size: int = 400, **options) -> bytes:
    from yamlformer.recipes.data.tokenizers import train_sentencepiece
    from yamlformer.recipes.recipe.sections import TokenizerSection

    section = TokenizerSection(type="sentencepiece", model_type=model_type, vocab_size=vocab_size)
    return train_sentencepiece(_stdlib_text(), section, options=options)


def _samples(text: str, n: int = 200) -> list[str]:
    rng = random.Random(0)
    out = [VARIED, "", " ", "\n", "    " * 10 + "if", "x" * 40]
    for _ in range(n):
        start = rng.randrange(len(text) - 500)
        out.append(text[start : start + rng.randrange(1, 500)])
    return out


def test_unigram_converts_up_to_equally_scored_segmentations():
    """tokenizers' Viterbi and sentencepiece's agree except between segmentations of equal
    score (runs of spaces split 12+16 or 16+12), where each breaks the tie its own way."""
    import sentencepiece as spm

    proto = _spm("unigram")
    sp = spm.SentencePieceProcessor(model_proto=proto)
    converted = from_sentencepiece(proto)
    same = 0
    samples = [s for s in _samples(_stdlib_text()) if "<unk>" not in s and "<s>" not in s]
    for text in samples:
        ours, theirs = sp.encode(text), converted.encode(text).ids
        if ours == theirs:
            same += 1
            continue
        assert sp.decode(theirs) == sp.decode(ours) == text
        assert sum(map(sp.get_score, theirs)) == pytest.approx(sum(map(sp.get_score, ours)), abs=1e-4)
    assert same >= 0.8 * len(samples)


def test_bpe_with_prose_settings_and_special_pieces_converts_exactly():
    """The encoder recipes' prose vocabulary: extra whitespace removed, a dummy prefix, nmt
    normalization (a precompiled map), control pieces for pad/bos/eos; ids go into the config."""
    import sentencepiece as spm

    proto = _spm(
        "bpe",
        normalization_rule_name="nmt_nfkc",
        remove_extra_whitespaces=True,
        add_dummy_prefix=True,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto)
    converted = from_sentencepiece(proto)
    for text in _samples(_stdlib_text(), 100):
        assert converted.encode(text).ids == sp.encode(text), repr(text)
        assert converted.decode(sp.encode(text)) == sp.decode(sp.encode(text))
    state = {"type": "sentencepiece", "model_proto": proto}
    assert token_ids(state) == {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}


def test_a_damaged_tokenizer_fails_the_import_in_one_line(exported, tmp_path, capsys):
    import shutil

    _, _, folder = exported
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    assert main(["import-hf", str(broken), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "tokenizer.json" in err and "\n" not in err and "Traceback" not in err


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
