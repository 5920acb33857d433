"""Encoder recipes: BERT masking statistics, a tiny MLM run, classification that learns a keyword
rule (accuracy and macro F1) from CSV and JSONL, starting from the MLM checkpoint's encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from data_helpers import keyword_examples, real_data_root, stand_in_files

torch.set_num_threads(1)


ENCODER = {
    "name": "tiny-encoder",
    "architecture": "encoder-only",
    "d_model": 48,
    "max_seq_len": 64,
    "tie_embeddings": True,
    "position": {"type": "learned"},
    "encoder": {
        "n_layers": 2,
        "attention": {"n_heads": 4},
        "ffn": {"type": "mlp", "activation": "gelu", "hidden_dim": 96},
        "norm": {"type": "layernorm", "placement": "pre"},
        "final_norm": True,
    },
    "head": {"type": "mlm"},
}


class _Tok:
    """Enough of a sentencepiece tokenizer for :class:`yamlformer.recipes.tasks.mlm.training.Specials`."""

    vocab_size = 100

    class sp:
        pad_id, unk_id, bos_id, eos_id = (lambda: 0), (lambda: 1), (lambda: 2), (lambda: 3)
        piece_to_id = staticmethod(lambda piece: 4 if piece == "[MASK]" else 1)


def test_masking_statistics_and_specials_untouched():
    from yamlformer.recipes.tasks.mlm.training import Specials, mask_tokens

    specials = Specials(_Tok())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (256, 512), generator=g)
    ids[:, 0], ids[:, -1], ids[:, 400:] = 2, 3, 0  # [CLS] first, [SEP] last, padding
    ids[:, 10] = 1  # [UNK] is special too
    inputs, labels = mask_tokens(ids, specials, g)
    special = torch.isin(ids, specials.ids)
    chosen = labels != -100
    assert not (chosen & special).any() and torch.equal(inputs[special], ids[special])
    assert torch.equal(labels[chosen], ids[chosen])
    share = chosen.sum() / (~special).sum()
    assert abs(share.item() - 0.15) < 0.005
    masked = inputs[chosen] == 4
    kept = inputs[chosen] == ids[chosen]
    replaced = ~masked & ~kept
    n = chosen.sum().item()
    assert abs(masked.sum().item() / n - 0.8) < 0.01
    assert abs(kept.sum().item() / n - 0.1) < 0.01  # a random draw equal to the token counts as kept (1%)
    assert abs(replaced.sum().item() / n - 0.1) < 0.01
    assert not torch.isin(inputs[chosen][replaced], specials.ids).any()
    assert torch.equal(inputs[~chosen], ids[~chosen])


def test_classification_metrics():
    from yamlformer.recipes.tasks.classification.training import classification_metrics

    predictions, labels = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 1, 1, 1, 0])
    m = classification_metrics(predictions, labels, 3)
    # F1: class 0 = 2*1/(2+2) = 0.5, class 1 = 2*2/(2+3) = 0.8, class 2 = 0 (predicted once, never true)
    assert m["accuracy"] == pytest.approx(0.6) and m["macro_f1"] == pytest.approx((0.5 + 0.8 + 0.0) / 3)


def _write_recipe(tmp_path: Path, name: str, recipe: dict) -> Path:
    base = {
        "name": name,
        "model": {"spec": ENCODER},
        "tokenizer": {"vocab_size": 600},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
        "schedule": {"type": "constant", "warmup_steps": 10},
        "trainer": {
            "accelerator": "cpu",
            "precision": "32",
            "devices": 1,
            "log_every_n_steps": 10,
            "checkpoint_every_n_steps": 1000,
            "output_dir": str(tmp_path / name),
        },
    }
    for key, value in recipe.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


@pytest.mark.slow  # 12 s: two runs
def test_mlm_run_then_classification_from_its_encoder(tmp_path, capsys):
    from yamlformer.builder.cli import main
    from yamlformer.recipes.trained import load_trained
    from yamlformer.recipes.training.run import run

    corpus = tmp_path / "corpus.txt"  # tiny Shakespeare when a local copy is here, else made-up prose like it
    real = real_data_root("tinyshakespeare.txt")
    text = (
        (real / "tinyshakespeare.txt").read_bytes()
        if real
        else stand_in_files("tinyshakespeare")["tinyshakespeare.txt"]
    )
    corpus.write_text(text.decode("utf-8")[:60_000], encoding="utf-8")
    mlm = _write_recipe(
        tmp_path,
        "mlm",
        {
            "task": "mlm",
            "data": {"sources": [str(corpus)], "seq_len": 32, "batch_size": 16, "cache_dir": str(tmp_path / "cache")},
            "trainer": {"max_steps": 100, "val_check_interval": 50, "limit_val_batches": 4},
        },
    )
    summary = run(mlm)
    assert summary["task"] == "mlm" and summary["steps"] == 100
    # each entry: the mean loss of a log interval (10 steps), the first one's included
    losses = [entry[1] for entry in torch.load(summary["last"], weights_only=True)["builder"]["history"]["train"]]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.75, losses
    assert 0 < summary["final"]["masked_accuracy"] < 1

    capsys.readouterr()
    assert main(["eval", summary["last"], "--json", "--max-batches", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == "mlm" and result["masked_tokens"] > 0 and result["loss"] < 7

    keyword_examples(tmp_path, 500, 100)
    classify = _write_recipe(
        tmp_path,
        "classify",
        {
            "task": "classification",
            "data": {
                "file": "train.csv",
                "validation": "val.jsonl",
                "max_len": 64,
                "max_tokens": 1024,
                "cache_dir": str(tmp_path / "cache"),
            },
            "classification": {"init_from": "mlm/checkpoints/last.ckpt", "pooling": "mean", "dropout": 0.0},
            "trainer": {"max_steps": 300, "val_check_interval": 150},  # 150 was marginal on stand-in data
        },
    )
    summary = run(classify)
    assert summary["final"]["accuracy"] > 0.95 and summary["final"]["macro_f1"] > 0.95, summary["final"]

    model, _, meta = load_trained(summary["last"])
    _, _, pretrained = load_trained(tmp_path / "mlm" / "checkpoints" / "last.ckpt")
    assert meta["labels"] == ["fruit", "none"] and meta["tokenizer"] == pretrained["tokenizer"]
    assert model.spec.head.type == "classification" and model.spec.head.n_classes == 2
    capsys.readouterr()
    assert main(["eval", summary["last"], "--data", str(tmp_path / "val.jsonl"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["examples"] == 100 and result["accuracy"] > 0.95
    assert main(["generate", summary["last"], "--text", "the green apple sits under a tree"]) == 0
    assert capsys.readouterr().out.split()[0] == "fruit"


def test_classification_starts_from_the_mlm_encoder(tmp_path):
    from yamlformer.builder import build_model
    from yamlformer.builder.spec.schema import spec_model
    from yamlformer.recipes.tasks.classification.training import load_encoder

    torch.manual_seed(0)
    mlm = build_model(spec_model().model_validate(dict(ENCODER, vocab_size=50)))
    path = tmp_path / "mlm.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in mlm.state_dict().items()}}, path)
    head = {"type": "classification", "n_classes": 3}
    classifier = build_model(spec_model().model_validate(dict(ENCODER, vocab_size=50, head=head)))
    load_encoder(classifier, path)
    for key, value in classifier.state_dict().items():
        if key.startswith("encoder."):
            assert torch.equal(value, mlm.state_dict()[key]), key
    wider = build_model(spec_model().model_validate(dict(ENCODER, vocab_size=50, d_model=64, head=head)))
    with pytest.raises(ValueError, match="does not fit this spec"):
        load_encoder(wider, path)


def test_encoder_recipe_rules(tmp_path):
    from yamlformer.builder.spec.loader import SpecError
    from yamlformer.recipes.tasks import load_recipe

    path = _write_recipe(tmp_path, "bad", {"task": "classification", "data": {"text_field": "body"}})
    with pytest.raises(SpecError, match="data.file"):
        load_recipe(path)
    path = _write_recipe(tmp_path, "char", {"task": "mlm", "tokenizer": {"type": "char"}})
    with pytest.raises(SpecError, match="sentencepiece"):
        load_recipe(path)
    path = _write_recipe(tmp_path, "typo", {"task": "mlm", "mlm": {"mask_prob": 0.15, "replace_maks": 0.8}})
    with pytest.raises(SpecError, match="replace_mask"):
        load_recipe(path)
