"""What a training step of ``builder train`` costs beyond the model's own work, on the CPU.

    python benchmarks/step_overhead.py [--steps 300] [--rounds 3] [--profile]

A tiny decoder (1 layer, d_model 32, batch 4 x 32 tokens), where a step's arithmetic is a few
milliseconds and everything else around it shows. Side by side in one process, alternating for
``--rounds`` rounds, the median milliseconds per step of:

* ``plain``: the built model in a plain PyTorch loop (AdamW, the learning rate set by hand,
  clipping, fp32 cross-entropy, batches already in memory): the floor for this model;
* ``recipe, workers 0`` and ``recipe, workers 1``: ``builder train``'s whole loop (Lightning, the
  module, its callbacks and logging, the data module) with batches made in the training process
  or in one worker process (``data.num_workers``).

``--profile`` adds the recipe's top functions by own time (cProfile), per step. On a GPU a step's
host time hides behind the kernels only while it is shorter than them: what shows here is what a
small or launch-bound model pays on any device.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[1]


class StepClock(L.Callback):
    """Wall seconds between consecutive training batch ends."""

    def __init__(self):
        self.seconds: list[float] = []
        self._last: float | None = None

    def on_train_batch_end(self, *args):
        now = time.perf_counter()
        if self._last is not None:
            self.seconds.append(now - self._last)
        self._last = now


def recipe_file(folder: Path, steps: int, workers: int) -> Path:
    import yaml

    doc = {
        "name": "overhead",
        "model": {
            "spec": {
                "name": "overhead",
                "architecture": "decoder-only",
                "d_model": 32,
                "max_seq_len": 32,
                "position": {"type": "rope"},
                "decoder": {
                    "n_layers": 1,
                    "attention": {"n_heads": 2, "n_kv_heads": 1},
                    "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 64},
                    "norm": {"type": "rmsnorm"},
                },
            }
        },
        "data": {
            "sources": ["python-stdlib"],
            "max_bytes": 200_000,
            "seq_len": 32,
            "batch_size": 4,
            "num_workers": workers,
            "cache_dir": str(folder / "cache"),
        },
        "tokenizer": {"type": "char"},
        "trainer": {
            "max_steps": steps,
            "val_check_interval": 10 * steps,
            "checkpoint_every_n_steps": 10 * steps,
            "log_every_n_steps": 50,
            "limit_val_batches": 1,
            "accelerator": "cpu",
            "precision": "32",
            "devices": 1,
            "output_dir": str(folder / f"run-{workers}"),
        },
        "sample": {"max_new_tokens": 0},
    }
    path = folder / f"overhead-{workers}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def recipe_ms(path: Path, profile: cProfile.Profile | None = None) -> float:
    from yamlformer.recipes.training.run import run

    clock = StepClock()
    if profile is not None:
        profile.enable()
    run(path, fresh=True, samples=False, callbacks=[clock])
    if profile is not None:
        profile.disable()
    return statistics.median(clock.seconds[len(clock.seconds) // 5 :]) * 1e3


def plain_ms(path: Path, steps: int) -> float:
    import torch.nn.functional as F

    from yamlformer.builder import build_model
    from yamlformer.recipes.recipe.sections import model_spec
    from yamlformer.recipes.tasks import load_recipe

    located = load_recipe(path)
    recipe = located.recipe
    vocab = 96
    torch.manual_seed(0)
    model = build_model(model_spec(located, vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = (torch.randint(0, vocab, (recipe.data.batch_size, recipe.data.seq_len)) for _ in range(2))
    seconds, last = [], time.perf_counter()
    for _ in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = 1e-3
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        seconds.append(now - last)
        last = now
    return statistics.median(seconds[steps // 5 :]) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per measurement (default 300)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--profile", action="store_true", help="also profile the recipe's loop (workers 0)")
    args = parser.parse_args(argv)
    if args.steps < 10 or args.rounds < 1:
        parser.error("--steps must be at least 10 and --rounds at least 1")
    torch.set_num_threads(1)
    results: dict[str, list[float]] = {"plain": [], "recipe, workers 0": [], "recipe, workers 1": []}
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        files = {workers: recipe_file(Path(tmp), args.steps, workers) for workers in (0, 1)}
        for _ in range(args.rounds):
            results["plain"].append(plain_ms(files[0], args.steps))
            for workers, path in files.items():
                results[f"recipe, workers {workers}"].append(recipe_ms(path))
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            recipe_ms(files[0], profile)
    floor = statistics.median(results["plain"])
    print(f"\n{args.steps} steps, {args.rounds} rounds, torch {torch.__version__}, one thread")
    print("| loop | ms per step (median of rounds) | over plain |\n|---|---:|---:|")
    for name, values in results.items():
        ms = statistics.median(values)
        print(f"| {name} | {ms:.2f} | {ms - floor:+.2f} ms ({ms / floor:.2f}x) |")
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
