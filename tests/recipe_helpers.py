"""A tiny recipe for the recipe tests: a 2-layer decoder on 60 kB of the standard library, char-level."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def tiny_recipe(tmp_path: Path, **sections) -> Path:
    """Write a tiny recipe under ``tmp_path`` (each keyword replaces or extends a section)."""
    recipe = {
        "name": "tiny",
        "model": {
            "spec": {
                "name": "tiny-decoder",
                "architecture": "decoder-only",
                "d_model": 32,
                "max_seq_len": 32,
                "tie_embeddings": True,
                "position": {"type": "rope"},
                "decoder": {
                    "n_layers": 2,
                    "attention": {"n_heads": 2},
                    "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 64},
                    "norm": {"type": "rmsnorm"},
                },
            }
        },
        "data": {
            "sources": ["python-stdlib"],
            "max_bytes": 60_000,
            "seq_len": 32,
            "batch_size": 4,
            "cache_dir": str(tmp_path / "cache"),
        },
        "tokenizer": {"type": "char"},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2},
        "trainer": {
            "max_steps": 12,
            "val_check_interval": 6,
            "limit_val_batches": 2,
            "checkpoint_every_n_steps": 4,
            "log_every_n_steps": 2,
            "accelerator": "cpu",
            "devices": 1,
            "output_dir": str(tmp_path / "run"),
        },
        "sample": {"prompts": ["def "], "max_new_tokens": 8},
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(recipe.get(name), dict):
            recipe[name] = {**recipe[name], **value}
        else:
            recipe[name] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def builder_process(*args: str, cwd: Path, **popen) -> subprocess.Popen:
    """``python -m builder.cli ARGS`` in a child process that imports this checkout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "builder.cli", *args], cwd=cwd, env=env, **popen)


def history(checkpoint: Path) -> dict:
    import torch

    return torch.load(checkpoint, map_location="cpu", weights_only=True)["builder"]["history"]
