"""Tiny recipes of every task for the precision x strategy x task matrix, on data made here (no
download, no local mirror needed): a run of a few steps, its checkpoint, a resume and the
result's ``eval`` and ``generate``."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from data_helpers import keyword_examples, stand_in_files
from recipe_helpers import TINY_SPEC

TASKS = ("lm", "translation", "mlm", "classification")

#: every recipe's trainer: a checkpoint every 2 steps, a loss entry every step, the schedule constant
#: (a run stopped at step N and resumed to M sees what an unbroken run to M sees)
TRAINER = {
    "val_check_interval": 1000,
    "limit_val_batches": 2,
    "checkpoint_every_n_steps": 2,
    "log_every_n_steps": 1,
    "gradient_clip_val": 0.5,
    "accelerator": "cpu",
}

_ENCODER = {
    "name": "tiny-encoder",
    "architecture": "encoder-only",
    "d_model": 32,
    "max_seq_len": 32,
    "tie_embeddings": True,
    "position": {"type": "learned"},
    "encoder": {
        "n_layers": 2,
        "attention": {"n_heads": 2},
        "ffn": {"type": "mlp", "activation": "gelu", "hidden_dim": 64},
        "norm": {"type": "layernorm", "placement": "pre"},
        "final_norm": True,
    },
}
_SEQ2SEQ = {
    "name": "tiny-seq2seq",
    "architecture": "encoder-decoder",
    "d_model": 32,
    "max_seq_len": 64,
    "tie_embeddings": True,
    "share_encoder_decoder_embeddings": True,
    "position": {"type": "sinusoidal"},
    "encoder": {
        "n_layers": 1,
        "attention": {"n_heads": 2},
        "ffn": {"type": "mlp", "activation": "relu", "hidden_dim": 64},
        "norm": {"type": "layernorm", "placement": "pre"},
        "final_norm": True,
    },
    "head": {"type": "lm"},
}
_SEQ2SEQ["decoder"] = _SEQ2SEQ["encoder"]


def _data(task: str, folder: Path) -> dict:
    """The recipe's ``data`` (and extra sections) for ``task``, its files written into ``folder``."""
    cache = str(folder / "cache")
    if task == "lm":
        return {
            "data": {
                "sources": ["python-stdlib"],
                "max_bytes": 60_000,
                "seq_len": 32,
                "batch_size": 4,
                "cache_dir": cache,
            },
            "tokenizer": {"type": "char"},
            "model": {"spec": copy.deepcopy(TINY_SPEC)},
        }
    if task == "mlm":
        text = stand_in_files("tinyshakespeare")["tinyshakespeare.txt"][:40_000]
        (folder / "corpus.txt").write_bytes(text)
        return {
            "task": "mlm",
            "data": {"sources": [str(folder / "corpus.txt")], "seq_len": 32, "batch_size": 4, "cache_dir": cache},
            "tokenizer": {"vocab_size": 300},
            "model": {"spec": dict(copy.deepcopy(_ENCODER), head={"type": "mlm"})},
        }
    if task == "classification":
        keyword_examples(folder, 160, 40)
        return {
            "task": "classification",
            "data": {
                "file": str(folder / "train.csv"),
                "validation": str(folder / "val.jsonl"),
                "max_len": 32,
                "max_tokens": 256,
                "cache_dir": cache,
            },
            "tokenizer": {"vocab_size": 320},
            "model": {"spec": dict(copy.deepcopy(_ENCODER), head={"type": "classification"})},
        }
    if task == "translation":
        files = stand_in_files("multi30k")
        for lang in ("de", "en"):
            lines = files[f"multi30k/train.{lang}"].decode().splitlines()[:300]
            (folder / f"pairs.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
        pairs = {"source": str(folder / "pairs.de"), "target": str(folder / "pairs.en")}
        return {
            "task": "translation",
            "data": {"train": pairs, "validation": pairs, "max_tokens": 300, "limit_pairs": 300, "cache_dir": cache},
            "tokenizer": {"vocab_size": 300},
            "model": {"spec": copy.deepcopy(_SEQ2SEQ)},
            "eval": {"num_beams": 1, "max_sentences": 8, "average_last": 1, "bleu_at_validation": False},
        }
    raise KeyError(task)


def task_recipe(task: str, folder: Path, precision: str, steps: int, **trainer) -> Path:
    """A tiny ``task`` recipe in ``folder`` forcing ``precision``, ``steps`` steps, its run under
    ``folder/run``; ``trainer`` extends :data:`TRAINER` (devices, strategy, ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe = {
        "name": f"tiny-{task}",
        **_data(task, folder),
        "optimizer": {"lr": 3e-3},
        "schedule": {"type": "constant", "warmup_steps": 2},
        "trainer": {
            **TRAINER,
            "devices": 1,
            "max_steps": steps,
            "precision": precision,
            "output_dir": str(folder / "run"),
            **trainer,
        },
    }
    if task == "lm":
        recipe["sample"] = {"prompts": [], "max_new_tokens": 0}
        if trainer.get("tensor_parallel", 1) > 1:
            # the char vocabulary is the corpus's characters (95 from this interpreter's standard
            # library, odd), which a vocab-parallel embedding refuses to split
            from sharded_helpers import EVEN_VOCAB

            recipe["tokenizer"] = dict(EVEN_VOCAB)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def eval_and_generate_args(task: str, folder: Path, checkpoint: Path) -> tuple[list[str], list[str] | None]:
    """``builder eval`` and ``builder generate`` arguments for the result of a ``task`` run (an MLM
    checkpoint has no ``generate``: None)."""
    ckpt = str(checkpoint)
    if task == "translation":
        return (
            [
                "eval",
                ckpt,
                "--src",
                str(folder / "pairs.de"),
                "--ref",
                str(folder / "pairs.en"),
                "--max-sentences",
                "4",
                "--num-beams",
                "1",
                "--json",
            ],
            ["generate", ckpt, "--text", "Ka lo mi."],
        )
    if task == "classification":
        return ["eval", ckpt, "--data", str(folder / "val.jsonl"), "--json"], [
            "generate",
            ckpt,
            "--text",
            "a green apple",
        ]
    evaluate = ["eval", ckpt, "--json", "--max-batches", "2"]
    return evaluate, (["generate", ckpt, "--text", "def ", "--max-new-tokens", "4"] if task == "lm" else None)
