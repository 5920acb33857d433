"""A tiny recipe for the recipe tests: a 2-layer decoder on 60 kB of the standard library, char-level."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

#: the spec every tiny recipe trains (tests that read its checkpoints build the same one)
TINY_SPEC = {
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


def tiny_recipe(tmp_path: Path, **sections) -> Path:
    """Write a tiny recipe under ``tmp_path`` (each keyword replaces or extends a section)."""
    recipe = {
        "name": "tiny",
        "model": {"spec": copy.deepcopy(TINY_SPEC)},
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
            "precision": "32",  # forced: `auto` differs by CPU (tests/test_precision.py covers both)
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
    """``python -m yamlformer.builder.cli ARGS`` in a child process that imports this checkout, as
    a command started from a shell is: without a rendezvous an earlier in-process run set."""
    from yamlformer.recipes.parallel.rendezvous import RENDEZVOUS_ENV

    env = {name: value for name, value in os.environ.items() if name not in RENDEZVOUS_ENV}
    return subprocess.Popen([sys.executable, "-m", "yamlformer.builder.cli", *args], cwd=cwd, env=env, **popen)


def history(checkpoint: Path) -> dict:
    import torch

    return torch.load(checkpoint, map_location="cpu", weights_only=True)["builder"]["history"]


#: the fault tests' trainer: checkpoints at steps 4, 6 (validation), 8 and 12 (validation, end)
FAULT_TRAINER = {"max_steps": 12, "val_check_interval": 6, "limit_val_batches": 2, "checkpoint_every_n_steps": 4}


def fault_recipe(tmp_path: Path, **trainer) -> Path:
    """The recipe the fault tests break and resume (:data:`FAULT_TRAINER`), writing under ``tmp_path/run``."""
    return tiny_recipe(tmp_path, trainer={**FAULT_TRAINER, "output_dir": str(tmp_path / "run"), **trainer})


def assert_same_run(a: Path, b: Path) -> None:
    """The two checkpoints hold the same training and validation losses, step for step, and weights."""
    import torch

    ha, hb = history(a), history(b)
    assert [s for s, _ in ha["train"]] == [s for s, _ in hb["train"]]
    torch.testing.assert_close(
        torch.tensor([x for _, x in ha["train"]]), torch.tensor([x for _, x in hb["train"]]), rtol=0, atol=1e-6
    )
    assert [v[0] for v in ha["val"]] == [v[0] for v in hb["val"]]
    torch.testing.assert_close(
        torch.tensor([v[1] for v in ha["val"]]), torch.tensor([v[1] for v in hb["val"]]), rtol=0, atol=1e-6
    )
    wa = torch.load(a, map_location="cpu", weights_only=True)["state_dict"]
    wb = torch.load(b, map_location="cpu", weights_only=True)["state_dict"]
    for name in wb:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-6)


def one_error_line(err: str, prefix: str) -> str:
    """The single line of ``err`` that starts with ``prefix`` (a command's error), after checking
    that no traceback was printed."""
    import re

    assert "Traceback" not in err, err[-3000:]
    plain = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "\n", err)  # progress bars move the cursor between lines
    lines = [line.strip() for line in re.split(r"[\r\n]", plain) if line.strip().startswith(prefix)]
    assert len(lines) == 1, err[-3000:]
    return lines[0]
