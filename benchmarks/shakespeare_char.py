"""nanoGPT's CPU shakespeare_char run, through our Lightning recipe and through a plain loop.

    python benchmarks/shakespeare_char.py [--max-steps 2000] [--target 1.886]

Both train the same built model (recipes/shakespeare-char.yaml: 4 layers, 4 heads, d_model 128,
block 64, batch 12, lr 1e-3 cosine to 1e-4 after 100 warmup steps, AdamW betas (0.9, 0.99),
grad clip 1.0, no dropout) on the same windows of tiny Shakespeare, validating every 250 steps
on 20 batches, as nanoGPT's `--eval_iters=20` CPU command does. The plain loop is the baseline
for the recipe's overhead (Lightning's hooks, logging, progress bar and checkpoints).

Prints time to the target validation loss (training wall time, validation included, setup
excluded), tokens/s at the median step time, and the overhead; the last line is JSON with
``seconds_to_target``, ``final_val_loss`` and ``tokens_per_s``. The anchor on the 2-core
development machine: nanoGPT reaches 1.886 in 101 s; its step runs ~16,000 tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# the data comes through the dataset registry (recipes/datasets.py): BUILDER_DATA, else a checkout's
# local copy at ../shared/data when there is one, else downloaded once into the user cache
if (REPO.parent / "shared" / "data").is_dir():
    os.environ.setdefault("BUILDER_DATA", str(REPO.parent / "shared" / "data"))


def plain_loop(recipe_path: Path, target: float) -> dict:
    """The same model, data, optimizer and schedule in a hand-written PyTorch loop."""
    import torch
    import torch.nn.functional as F

    from builder import build_model
    from recipes.config import load_recipe
    from recipes.data import TrainWindows, ValWindows, split
    from recipes.module import lr_multiplier, param_groups
    from recipes.train import prepare

    recipe = load_recipe(recipe_path)
    t, d, opt = recipe.trainer, recipe.data, recipe.optimizer
    _, _, tokens, spec = prepare(recipe, recipe_path)
    train_tokens, val_tokens = split(tokens, d.val_fraction, d.seq_len)
    torch.manual_seed(t.seed)
    model = build_model(spec)
    optimizer = torch.optim.AdamW(param_groups(model, opt.weight_decay, opt.decay_embeddings), lr=opt.lr, betas=opt.betas, eps=opt.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, recipe.schedule, opt.lr, t.max_steps)
    )
    batches = iter(TrainWindows(train_tokens, d.seq_len, d.batch_size, t.seed, 0, 1, 0))
    val = ValWindows(val_tokens, d.seq_len, d.batch_size, t.limit_val_batches, t.seed, 0, 1)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in val]
        model.train()
        return sum(losses) / len(losses)

    model.train()
    step_seconds, val_history = [], []
    start = last = time.perf_counter()
    for step in range(1, t.max_steps + 1):
        x, y = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.gradient_clip_val)
        optimizer.step()
        schedule.step()
        loss.item()  # the recipe reads the loss every step too
        now = time.perf_counter()
        step_seconds.append(now - last)
        last = now
        if step % t.val_check_interval == 0:
            val_history.append((step, evaluate(), time.perf_counter() - start))
            print(f"  plain  step {step}: val loss {val_history[-1][1]:.4f} at {val_history[-1][2]:.1f} s", flush=True)
            last = time.perf_counter()
            step_seconds.pop()  # the step that ran into validation is not counted (as in the recipe)
    ordered = sorted(step_seconds)
    return {
        "val": val_history,
        "tokens_per_s": d.batch_size * d.seq_len / ordered[len(ordered) // 2],
    }


def recipe_run(recipe_path: Path, out: Path) -> dict:
    from recipes.train import run

    summary = run(recipe_path, {"trainer.output_dir": str(out)}, fresh=True, samples=False)
    import torch

    history = torch.load(summary["last"], map_location="cpu", weights_only=True)["builder"]["history"]
    return {"val": history["val"], "tokens_per_s": summary["tokens_per_s"]}


def to_target(val: list, target: float) -> float | None:
    return next((seconds for _, loss, seconds in val if loss <= target), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "shakespeare-char.yaml"))
    parser.add_argument("--target", type=float, default=1.886, help="validation loss to reach (nanoGPT's)")
    args = parser.parse_args(argv)
    recipe_path = Path(args.recipe)

    print("plain PyTorch loop (baseline) ...", flush=True)
    plain = plain_loop(recipe_path, args.target)
    with tempfile.TemporaryDirectory() as tmp:
        print("Lightning recipe ...", flush=True)
        ours = recipe_run(recipe_path, Path(tmp) / "run")

    result = {
        "seconds_to_target": to_target(ours["val"], args.target),
        "final_val_loss": ours["val"][-1][1],
        "tokens_per_s": round(ours["tokens_per_s"]),
        "target": args.target,
        "baseline_seconds_to_target": to_target(plain["val"], args.target),
        "baseline_final_val_loss": plain["val"][-1][1],
        "baseline_tokens_per_s": round(plain["tokens_per_s"]),
        "overhead": plain["tokens_per_s"] / ours["tokens_per_s"] - 1,
    }
    print(f"\nrecipe: val {result['final_val_loss']:.4f}, {result['tokens_per_s']:,} tokens/s, "
          f"target {args.target} at {result['seconds_to_target']} s")
    print(f"plain:  val {result['baseline_final_val_loss']:.4f}, {result['baseline_tokens_per_s']:,} tokens/s, "
          f"target at {result['baseline_seconds_to_target']} s")
    print(f"recipe overhead over the plain loop: {result['overhead']:+.1%} (median step times)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
