"""Recipes that train on token files other tools wrote and on mixtures: Megatron-LM datasets,
nanoGPT's raw .bin files, `builder tokenize` outputs and text, by weight (yamlformer.recipes.data.corpus)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import yaml
from recipe_helpers import tiny_recipe

from yamlformer.recipes.errors import RecipeError

TEXT = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A small sentencepiece model (with an EOS) and the documents it tokenizes."""
    from yamlformer.recipes.data.tokenizers import SentencePieceTokenizer, train_sentencepiece
    from yamlformer.recipes.recipe.sections import TokenizerSection

    folder = tmp_path_factory.mktemp("tokenizer")
    proto = train_sentencepiece(TEXT, TokenizerSection(vocab_size=300))
    (folder / "spm.model").write_bytes(proto)
    return folder / "spm.model", SentencePieceTokenizer(proto)


def token_documents(tokenizer, n=300, seed=0):
    rng = np.random.default_rng(seed)
    lines = TEXT.split("\n\n")
    docs = ["\n".join(rng.choice(lines, size=int(rng.integers(1, 6)))) for _ in range(n)]
    eos = tokenizer.eos_id
    return [np.array(tokenizer.encode(d) + ([eos] if eos is not None else []), dtype=np.uint16) for d in docs]


def recipe_for(tmp_path, model_file, sources, **data):
    return tiny_recipe(
        tmp_path,
        data={
            "sources": sources,
            "seq_len": 32,
            "batch_size": 4,
            "num_workers": 0,
            "cache_dir": str(tmp_path / "cache"),
            **data,
        },
        tokenizer={"type": "sentencepiece", "model_file": str(model_file)},
    )


def test_a_megatron_dataset_and_a_raw_bin_train_as_a_weighted_mixture_and_resume(tmp_path, tokenizer_file):
    from yamlformer.recipes.data.megatron import write_megatron
    from yamlformer.recipes.training.run import run

    model_file, tokenizer = tokenizer_file
    write_megatron(tmp_path / "code_text_document", token_documents(tokenizer, seed=1))
    np.concatenate(token_documents(tokenizer, seed=2)).tofile(tmp_path / "train.bin")
    np.concatenate(token_documents(tokenizer, n=60, seed=3)).tofile(tmp_path / "val.bin")
    sources = [
        {"path": "code_text_document.idx", "weight": 3.0},
        {"path": "train.bin", "weight": 1.0, "validation": "val.bin"},
    ]
    path = recipe_for(tmp_path, model_file, sources)  # the schedule fixed: a run stopped at 6 is the first half of 12
    recipe = yaml.safe_load(path.read_text())
    recipe["schedule"]["decay_steps"] = 12
    path.write_text(yaml.safe_dump(recipe))
    unbroken = run(path, overrides={"trainer.output_dir": str(tmp_path / "unbroken")}, samples=False)
    first = run(path, overrides={"trainer.max_steps": 6}, samples=False)
    resumed = run(path, samples=False)
    assert first["steps"] == 6 and resumed["steps"] == unbroken["steps"] == 12
    assert resumed["val_loss"] == pytest.approx(unbroken["val_loss"], abs=1e-5)
    assert resumed["train_loss"] == pytest.approx(unbroken["train_loss"], abs=1e-5)


def test_a_document_masked_mixture_trains(tmp_path, tokenizer_file):
    from yamlformer.recipes.data.megatron import write_megatron
    from yamlformer.recipes.training.run import run

    model_file, tokenizer = tokenizer_file
    write_megatron(tmp_path / "docs", token_documents(tokenizer))
    summary = run(recipe_for(tmp_path, model_file, ["docs"], packing="doc_masked"), samples=False)
    assert summary["steps"] == 12 and np.isfinite(summary["val_loss"])


def test_the_dry_run_shows_each_source_s_share_and_epochs_and_both_refuse_past_a_limit(tmp_path, tokenizer_file):
    from yamlformer.recipes.data.megatron import write_megatron
    from yamlformer.recipes.training.dry_run import dry_run
    from yamlformer.recipes.training.run import run

    model_file, tokenizer = tokenizer_file
    write_megatron(tmp_path / "small", token_documents(tokenizer, n=20))
    write_megatron(tmp_path / "large", token_documents(tokenizer, n=300, seed=4))
    sources = [{"path": "small", "weight": 1.0, "max_epochs": 1.0}, {"path": "large", "weight": 1.0}]
    path = recipe_for(tmp_path, model_file, sources)
    out = io.StringIO()
    dry_run(path, {"trainer.max_steps": 20}, out=out)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("mixture")]
    assert len(lines) == 2 and "50.0% of the windows" in lines[0] and "epochs in 20 steps" in lines[0]
    for start in (dry_run, run):  # what the dry run accepts the run accepts, and no more
        with pytest.raises(RecipeError, match=r"data.sources\[0\].max_epochs: small would be seen [\d.]+ times"):
            start(path, {"trainer.max_steps": 200})


def test_a_token_file_made_with_a_larger_vocabulary_is_refused_naming_it(tmp_path, tokenizer_file):
    from yamlformer.recipes.training.run import run

    model_file, _ = tokenizer_file
    np.arange(0, 5000, dtype=np.uint16).tofile(tmp_path / "other.bin")
    with pytest.raises(RecipeError, match=r"other\.bin: token id \d+ is outside the tokenizer's vocabulary of 300"):
        run(recipe_for(tmp_path, model_file, ["other.bin"]), samples=False)


def test_token_files_without_a_tokenizer_are_refused_with_what_to_set(tmp_path, tokenizer_file):
    from yamlformer.recipes.training.run import run

    np.arange(0, 200, dtype=np.uint16).tofile(tmp_path / "t.bin")
    path = tiny_recipe(
        tmp_path, data={"sources": ["t.bin"], "cache_dir": str(tmp_path / "cache")}, tokenizer={"type": "sentencepiece"}
    )
    with pytest.raises(RecipeError, match="carry no tokenizer; set tokenizer.model_file"):
        run(path, samples=False)


def test_a_weight_that_is_not_positive_is_refused_where_it_is_written(tmp_path):
    from yamlformer.builder.spec.loader import SpecError
    from yamlformer.recipes.tasks import load_recipe

    path = tiny_recipe(tmp_path, data={"sources": [{"path": "a.bin", "weight": 0}]})
    with pytest.raises(SpecError) as caught:
        load_recipe(path)
    line = str(caught.value)
    assert line == f"{path}:24:13: data.sources.0.weight: must be > 0.0, got 0"


def test_a_tokenize_output_and_text_train_together_with_the_dataset_s_tokenizer(tmp_path, tokenizer_file, capsys):
    import json

    from yamlformer.builder.cli import main
    from yamlformer.recipes.training.run import run

    model_file, tokenizer = tokenizer_file
    lines = [json.dumps({"text": chunk}) for chunk in TEXT.split("\n\n")[:300]]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    assert (
        main(
            [
                "tokenize",
                str(tmp_path / "corpus.jsonl"),
                "-o",
                str(tmp_path / "web.tok"),
                "--tokenizer",
                str(model_file),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text(TEXT[:20_000])
    sources = [{"path": "web.tok", "weight": 2.0}, {"path": "notes", "weight": 1.0}]
    path = tiny_recipe(
        tmp_path,
        data={
            "sources": sources,
            "seq_len": 32,
            "batch_size": 4,
            "num_workers": 0,
            "cache_dir": str(tmp_path / "cache"),
        },
    )  # a char tokenizer, not used
    capsys.readouterr()
    summary = run(path, samples=False)
    out = capsys.readouterr().out
    assert summary["steps"] == 12 and "corpus: 2 sources" in out and "(sentencepiece, vocab 300)" in out
    assert "mixture: web.tok 67% " in out


def test_caches_go_to_the_user_cache_unless_an_earlier_version_left_one_here(tmp_path, monkeypatch):
    import platformdirs

    from yamlformer.recipes.recipe.sections import DataSection

    monkeypatch.chdir(tmp_path)
    assert DataSection().cache_dir == platformdirs.user_cache_dir("builder", appauthor=False)
    (tmp_path / ".cache" / "builder").mkdir(parents=True)  # what earlier versions wrote under the working folder
    assert DataSection().cache_dir == ".cache/builder"
    assert DataSection(cache_dir="mine").cache_dir == "mine"


class _Counting:
    """A tokenizer that counts the texts it is asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, 0

    def encode(self, text):
        self.encoded += 1
        return self.tokenizer.encode(text)

    def encode_batch(self, texts):
        self.encoded += len(texts)
        return self.tokenizer.encode_batch(texts)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_eval_tokenizes_its_files_once_and_reads_its_corpus_text_once(tmp_path, tokenizer_file, monkeypatch):
    """`builder eval` re-read and re-tokenized its text on every run (16 s for 10 tiny batches):
    the tokens of `--data` are cached, and a recipe's text is found in the cache by its files'
    names, sizes and times, not read and hashed again."""
    from pathlib import Path

    from yamlformer.recipes.data.corpus import open_corpus
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.tasks.lm.training import file_tokens

    _, sp = tokenizer_file
    (tmp_path / "data").mkdir()
    for i, part in enumerate(TEXT.split("\n\n")[:30]):
        (tmp_path / "data" / f"{i:02d}.py").write_text(part)
    cache = str(tmp_path / "cache")
    counting = _Counting(sp)
    first = file_tokens([str(tmp_path / "data")], counting, cache)
    eos = [] if sp.eos_id is None else [sp.eos_id]
    texts = [(tmp_path / "data" / f"{i:02d}.py").read_text() for i in range(30)]
    assert first.tolist() == [i for text in texts for i in sp.encode(text) + eos]  # what it always scored
    assert counting.encoded == 30
    again = file_tokens([str(tmp_path / "data")], counting, cache)
    assert counting.encoded == 30 and np.array_equal(again, first)  # tokenized once

    recipe = load_recipe(recipe_for(tmp_path, tokenizer_file[0], [str(tmp_path / "data")])).recipe
    open_corpus(recipe.data, None, None, False, pretrained=sp)  # the run's first look: reads the text
    reads = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (reads.append(self), real(self, *a, **k))[1])
    corpus = open_corpus(recipe.data, None, None, False, pretrained=sp)  # an eval's: none of it
    assert not [p for p in reads if p.parent == tmp_path / "data"] and corpus.sources[0].train.n_tokens > 0
    (tmp_path / "data" / "00.py").write_text("def changed():\n    return 0\n")  # a file changed: read again
    open_corpus(recipe.data, None, None, False, pretrained=sp)
    assert [p for p in reads if p.parent == tmp_path / "data"]
