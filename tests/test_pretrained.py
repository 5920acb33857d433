"""Fine-tuning from trained weights (``model.init_from``) with parts frozen (``model.freeze``):
a tiny imported BERT fine-tuned for classification, a tiny Hugging Face Llama fine-tuned on text,
a run started from another run's checkpoint, and the errors that name what does not fit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml
from recipe_helpers import tiny_recipe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _state(summary) -> dict:
    from yamlformer.builder.checkpoints import model_weights

    return model_weights(torch.load(summary["last"], map_location="cpu", weights_only=True)["state_dict"])


def _train_losses(summary) -> list[float]:
    history = torch.load(summary["last"], map_location="cpu", weights_only=True)["builder"]["history"]
    return [loss for _, loss in history["train"]]


def _keyword_rows(n: int) -> list[str]:
    """``label<TAB>text`` rows: "fruit" when the text mentions apple, else "none"."""
    rng = random.Random(0)
    words = [
        "the",
        "a",
        "cat",
        "dog",
        "runs",
        "sits",
        "blue",
        "green",
        "house",
        "tree",
        "river",
        "stone",
        "bread",
        "milk",
        "over",
        "under",
    ]
    rows = []
    for i in range(n):
        text = [rng.choice(words) for _ in range(rng.randint(4, 9))]
        if i % 2:
            text.insert(rng.randrange(len(text) + 1), "apple")
        rows.append((" ".join(text), "fruit" if i % 2 else "none"))
    return rows


def test_tiny_imported_bert_fine_tunes_for_classification_with_its_embeddings_frozen(tmp_path):
    from yamlformer.builder.hf import import_hf, read_weights
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.tasks.mlm.training import encoder_tokenizer
    from yamlformer.recipes.training.run import run

    rows = _keyword_rows(400)
    for label in ("fruit", "none"):
        (tmp_path / f"{label}.txt").write_text("\n".join(t for t, lab in rows if lab == label) + "\n")
    recipe = {
        "name": "bert-classify",
        "task": "classification",
        "model": {"init_from": "bert-imported", "freeze": ["embedding"]},
        "data": {
            "by_label": {"fruit": "fruit.txt", "none": "none.txt"},
            "max_len": 32,
            "max_tokens": 512,
            "cache_dir": str(tmp_path / "cache"),
        },
        "tokenizer": {"vocab_size": 320},
        "classification": {"pooling": "first", "dropout": 0.0},
        "optimizer": {"lr": 2e-3, "weight_decay": 0.0},
        "schedule": {"type": "constant", "warmup_steps": 5},
        "trainer": {
            "max_steps": 80,
            "val_check_interval": 40,
            "log_every_n_steps": 10,
            "accelerator": "cpu",
            "precision": "32",
            "devices": 1,
            "output_dir": str(tmp_path / "run"),
        },
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    # the recipe's own vocabulary (cached: the run reads the same one) sizes the BERT to import
    text = "\n".join(t for t, _ in rows)
    vocab = encoder_tokenizer(load_recipe(path), text, "probe").vocab_size

    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            type_vocab_size=2,
        )
    )
    bert.save_pretrained(tmp_path / "bert-hf")
    import_hf(tmp_path / "bert-hf", tmp_path / "bert-imported")
    imported = read_weights(tmp_path / "bert-imported" / "model.safetensors")

    summary = run(path, samples=False)
    losses = _train_losses(summary)
    assert losses[-1] < losses[0] - 0.3, losses
    assert summary["val_metrics"]["accuracy"] > 0.8, summary["val_metrics"]
    state = _state(summary)
    for name, value in imported.items():
        if name.startswith("encoder.embedding."):
            assert torch.equal(state[name], value), name  # frozen
    assert not torch.equal(
        state["encoder.layers.1.ffn.up_proj.weight"], imported["encoder.layers.1.ffn.up_proj.weight"]
    )


def test_tiny_hugging_face_llama_fine_tunes_on_text_with_a_layer_frozen(tmp_path, capsys):
    from yamlformer.builder.hf import from_hf
    from yamlformer.recipes.training.run import run

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(600)))
    vocab = len(set(corpus.read_text())) + 1  # the char tokenizer's vocabulary: its characters and eos
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
        )
    )
    llama.save_pretrained(tmp_path / "llama")
    _, imported = from_hf(tmp_path / "llama")

    path = tiny_recipe(
        tmp_path,
        model={"spec": None, "init_from": "llama", "freeze": ["decoder.layers.0"]},
        data={
            "sources": [str(corpus)],
            "max_bytes": None,
            "seq_len": 32,
            "batch_size": 8,
            "cache_dir": str(tmp_path / "cache"),
        },
        trainer={"max_steps": 40, "val_check_interval": 40, "log_every_n_steps": 5},
    )
    summary = run(path, samples=False)
    out = capsys.readouterr().out
    assert "weights: " in out and "Hugging Face folder" in out and "frozen: " in out
    losses = _train_losses(summary)
    assert losses[-1] < losses[0] - 0.5, losses
    state = _state(summary)
    for name, value in imported.items():
        if name.startswith("decoder.layers.0."):
            assert torch.equal(state[name], value), name
    assert not torch.equal(
        state["decoder.layers.1.attention.q_proj.weight"], imported["decoder.layers.1.attention.q_proj.weight"]
    )


def test_a_run_starts_from_another_runs_checkpoint_with_its_tokenizer(tmp_path):
    from yamlformer.recipes.training.run import run

    first = tmp_path / "first"
    first.mkdir()
    summary = run(tiny_recipe(first, trainer={"max_steps": 30, "log_every_n_steps": 5}), samples=False)
    second = tmp_path / "second"
    second.mkdir()
    # no spec and a tokenizer section that would build another vocabulary: both come from the checkpoint
    recipe = tiny_recipe(
        second,
        model={"spec": None, "init_from": summary["last"]},
        tokenizer={"type": "sentencepiece"},
        trainer={"max_steps": 5, "log_every_n_steps": 5},
    )
    started = run(recipe, samples=False)
    fresh = _train_losses(summary)[0]
    assert _train_losses(started)[0] < fresh - 0.5  # it picks up where the first run ended
    meta = torch.load(started["last"], weights_only=True)["builder"]
    first_meta = torch.load(summary["last"], weights_only=True)["builder"]
    assert meta["tokenizer"] == first_meta["tokenizer"] and meta["spec"]["name"] == first_meta["spec"]["name"]


def test_init_from_names_the_tensor_that_does_not_fit(tmp_path):
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.training.run import run

    first = tmp_path / "first"
    first.mkdir()
    summary = run(tiny_recipe(first, trainer={"max_steps": 2}), samples=False)
    second = tmp_path / "second"
    second.mkdir()
    wider = tiny_recipe(
        second,
        model={
            "spec": yaml.safe_load((first / "recipe.yaml").read_text())["model"]["spec"],
            "init_from": summary["last"],
            "overrides": {"d_model": 48},
        },
    )
    with pytest.raises(
        RecipeError,
        match=r"decoder\.embedding\.tokens\.weight has shape \(\d+, 32\) in .* but "
        r"\(\d+, 48\) in this model",
    ):
        run(wider, samples=False)
    with pytest.raises(RecipeError, match="is neither a `builder train` checkpoint"):
        run(tiny_recipe(second, model={"init_from": str(tmp_path)}), samples=False)


def test_a_vocabulary_that_differs_from_the_weights_says_so(tmp_path):
    from yamlformer.recipes.errors import RecipeError
    from yamlformer.recipes.training.run import run

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
        )
    ).save_pretrained(tmp_path / "llama")
    with pytest.raises(RecipeError, match="the vocabulary differs .* the weights 300"):
        run(tiny_recipe(tmp_path, model={"spec": None, "init_from": "llama"}), samples=False)


def test_freeze_paths_are_checked_where_they_are_written(tmp_path):
    from yamlformer.builder.spec.loader import SpecError
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.run import run

    path = tiny_recipe(tmp_path, model={"spec": "../spec.yaml", "freeze": ["decoder..layers"]})
    with pytest.raises(SpecError, match=r"recipe\.yaml:\d+:\d+: model\.freeze.*not a dotted path"):
        load_recipe(path)
    path = tiny_recipe(tmp_path, model={"spec": "../spec.yaml", "freeze": ["layers.3-1"]})
    with pytest.raises(SpecError, match="runs backwards; write 1-3"):
        load_recipe(path)

    spec = yaml.safe_load(tiny_recipe(tmp_path).read_text())["model"]["spec"]
    path = tiny_recipe(tmp_path, model={"spec": spec, "freeze": ["embedding", "decoder.layer.0"]})
    with pytest.raises(SpecError) as info:
        run(path, samples=False)
    message = str(info.value)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "decoder.layer.0" in text)
    assert (
        f"recipe.yaml:{line}:" in message and "model.freeze.1: 'decoder.layer.0' names no part of the model" in message
    )
    assert "did you mean 'decoder.layers.0-1'" in message
    path = tiny_recipe(tmp_path, model={"spec": spec, "freeze": ["layers.0-3"]})
    with pytest.raises(SpecError, match="'layers.0-3': decoder.layers has 0-1, not 0-3"):
        run(path, samples=False)
    path = tiny_recipe(tmp_path, model={"spec": spec, "freeze": ["decoder", "head"]})
    with pytest.raises(Exception, match="nothing would train"):
        run(path, samples=False)


def test_freeze_matches_ranges_wildcards_and_paths_below_the_stacks():
    from yamlformer.builder import build_model, load_spec
    from yamlformer.recipes.training.pretrained import freeze

    spec = load_spec(
        Path(__file__).resolve().parents[1] / "specs" / "tiny" / "llama.yaml", overrides={"decoder.n_layers": 4}
    )
    model = build_model(spec)
    freeze(model, ["layers.1-2.attention", "decoder.layers.*.ffn_norm"])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {
        n
        for n, _ in model.named_parameters()
        if n.startswith(("decoder.layers.1.attention.", "decoder.layers.2.attention.")) or ".ffn_norm." in n
    }
