"""The sections of ``benchmarks/gpu_check.py``, each run in a process of its own under a time limit.

A section returns ``{"rows": [dict, ...], "ok": bool, ...}``; gpu_check prints its rows as a table
the moment the section ends. ``cpu=True`` runs each one's plumbing at a tiny size on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
from gpu_check import wait_or_kill  # benchmarks/gpu_check.py

REPO = Path(__file__).resolve().parents[1]

#: Lightning's launch variables, which an in-process run leaves in this process's environment:
#: a child that inherits ``LOCAL_RANK`` takes itself for a rank started by a launcher
LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def write_recipe(folder: Path, name: str, spec: dict, data: dict, trainer: dict, **sections) -> Path:
    """A recipe file in ``folder``: ``spec`` inline, the Python standard library's source as data
    (no download), a character vocabulary, no samples."""
    import yaml

    doc = {
        "name": name,
        "model": {"spec": spec},
        "data": {"sources": ["python-stdlib"], "cache_dir": str(folder / "cache"), **data},
        "tokenizer": {"type": "char"},
        "trainer": {"output_dir": str(folder / "run"), "limit_val_batches": 1, **trainer},
        "sample": {"max_new_tokens": 0},
        **sections,
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class FirstStep(L.Callback):
    """Seconds from the start of training to the end of its first optimizer step (data, model
    compilation, kernel autotuning and the step itself), the device synchronised."""

    def __init__(self):
        self.seconds: float | None = None
        self._start = 0.0

    def on_train_start(self, trainer, pl_module):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.seconds is None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self.seconds = time.perf_counter() - self._start


# -- recipes: every shipped recipe a few steps in `auto` ----------------------------------------------


def shipped_recipes() -> list[str]:
    from yamlformer.builder.zoo import entries

    return [e.name for e in entries().values() if e.kind == "recipe"]


def recipe_worker(name: str, overrides: dict, result: Path) -> None:
    """One recipe as ``builder train`` runs it; rank 0 writes what came of it to ``result``."""
    from yamlformer.recipes.data.registry import DatasetError
    from yamlformer.recipes.recipe.sections import recipe_path
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.run import for_this_machine, run

    row: dict = {"recipe": name, "precision": None, "steps": None, "first_step_s": None, "tokens_per_s": None}
    first = FirstStep()
    try:
        path = recipe_path(name)
        row["precision"] = for_this_machine(load_recipe(path, overrides).recipe, quiet=True).trainer.precision
        summary = run(path, overrides, fresh=True, samples=False, callbacks=[first])
        loss = summary["train_loss"]
        ok = loss is not None and math.isfinite(loss)
        row.update(steps=summary["steps"], first_step_s=first.seconds, tokens_per_s=summary["tokens_per_s"])
        row.update(train_loss=loss, status="ok" if ok else "failed: loss not finite")
    except DatasetError as exc:  # not on disk and not downloadable here
        row.update(status="skipped: no data", error=str(exc).splitlines()[0][:200])
    except Exception as exc:
        row.update(status="failed", error=f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:300])
    if os.environ.get("LOCAL_RANK", "0") == "0":
        result.write_text(json.dumps(row))


def recipes(cpu: bool, folder: Path, budget: float, out: Path | None = None) -> dict:
    """Each shipped recipe ``steps`` steps in its own process (``trainer.precision: auto``, one
    validation at the end), each with its share of the section's time."""
    names = ["lm-stdlib"] if cpu else shipped_recipes()  # on the CPU: the default recipe's plumbing
    steps = 2 if cpu else 10
    rows, started = [], time.perf_counter()
    for i, name in enumerate(names):
        left = budget - (time.perf_counter() - started)
        limit = max(10.0, left / (len(names) - i))
        out = folder / name
        out.mkdir()
        overrides = {
            "trainer.precision": "auto",
            "trainer.max_time": None,
            "trainer.max_steps": steps,
            "trainer.val_check_interval": steps,
            "trainer.log_every_n_steps": max(1, steps // 5),
            "trainer.accelerator": "cpu" if cpu else "cuda",
            "trainer.devices": 1,
            "trainer.output_dir": str(out / "run"),
        }
        if cpu:
            overrides.update({"data.max_bytes": 200_000, "model.overrides.decoder.n_layers": 1})
        rows.append(child_row(["--recipe-worker", name, json.dumps(overrides)], out, limit, {"recipe": name}))
        print(f"  recipe {name}: {rows[-1]['status']}", flush=True)
    return {"rows": rows, "ok": not any(r["status"].startswith("failed") for r in rows)}


def child_row(args: list[str], folder: Path, limit: float, base: dict) -> dict:
    """``gpu_check.py ARGS RESULT`` in a child process killed after ``limit`` seconds; its JSON
    result, or a failed row naming what happened."""
    result, log = folder / "result.json", folder / "output.txt"
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), *args, str(result)]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    started = time.perf_counter()
    with open(log, "wb") as out:
        child = subprocess.Popen(
            command, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = wait_or_kill(child, limit)
    seconds = time.perf_counter() - started
    if result.is_file():
        return {**json.loads(result.read_text()), "seconds": seconds}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    error = f"timed out after {limit:.0f} s" if timed_out else (lines[-1].strip()[:300] if lines else "no output")
    return {**base, "status": "failed", "error": error, "seconds": seconds}


# -- fsdp: FSDP2 in bf16, MFU and memory against the estimate ----------------------------------------


def fsdp(cpu: bool, folder: Path, budget: float, out: Path | None = None) -> dict:
    """The record's single-GPU FSDP2 run (0.38B: 8 x 2048, 16/8 heads, SwiGLU 5632, seq 2048,
    batch 8, bf16-mixed): tokens/s, MFU, and the memory estimate against max_memory_allocated."""
    from yamlformer.builder.analysis.estimates import Step, estimate
    from yamlformer.builder.analysis.layout import Layout
    from yamlformer.builder.analysis.mfu import peak_flops
    from yamlformer.builder.checkpoints import peek_meta
    from yamlformer.recipes.recipe.sections import model_spec
    from yamlformer.recipes.tasks import load_recipe
    from yamlformer.recipes.training.run import run

    layers, seq, batch, steps = (1, 64, 2, 2) if cpu else (8, 2048, 8, 20)
    spec = {
        "name": f"gpu-check-{layers}x2048",
        "architecture": "decoder-only",
        "d_model": 256 if cpu else 2048,
        "max_seq_len": max(seq, 64),
        "position": {"type": "rope", "theta": 10000.0},
        "decoder": {
            "n_layers": layers,
            "attention": {"n_heads": 16, "n_kv_heads": 8},
            "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 512 if cpu else 5632},
            "norm": {"type": "rmsnorm"},
        },
    }
    trainer = {
        "max_steps": steps,
        "val_check_interval": 10 * steps,
        "checkpoint_every_n_steps": 10 * steps,
        "log_every_n_steps": max(1, steps // 4),
        "precision": "bf16-mixed",
        "strategy": "fsdp",
        "accelerator": "cpu" if cpu else "cuda",
        "devices": 1,
    }
    data = {"max_bytes": 300_000 if cpu else 4_000_000, "seq_len": seq, "batch_size": batch}
    path = write_recipe(folder, "fsdp", spec, data, trainer, optimizer={"lr": 3e-4, "weight_decay": 0.1})
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    summary = run(path, samples=False)
    allocated = None if cpu else torch.cuda.max_memory_allocated()
    vocab = peek_meta(Path(summary["last"]))["builder"]["spec"]["vocab_size"]
    model = model_spec(load_recipe(path), vocab)
    est = estimate(model, Step(seq_len=seq, batch=batch, dtype="bf16"), Layout(devices=1, strategy="fsdp"))
    device = "cpu" if cpu else torch.cuda.get_device_name()
    peak = peak_flops(device, "bf16")
    tokens = summary["tokens_per_s"]
    mfu = tokens * est.flops.train_per_token / peak if tokens and peak else None
    row = {
        "params": est.params.total,
        "steps": summary["steps"],
        "tokens_per_s": tokens,
        "mfu": mfu,
        "memory_estimate": est.memory.training_total,
        "max_memory_allocated": allocated,
        "ratio": allocated / est.memory.training_total if allocated else None,
    }
    return {"rows": [row], "ok": summary["steps"] == steps}


# -- compile: `compile: true` through the Triton attention op -----------------------------------------


def compile_section(cpu: bool, folder: Path, budget: float, out: Path | None = None) -> dict:
    """A Mistral-style windowed model (``auto`` runs our Triton op for the window), eager and
    ``trainer.compile: true``: both train, and what compiling buys."""
    layers, d_model, seq, batch, steps = (1, 64, 32, 2, 3) if cpu else (6, 768, 1024, 8, 30)
    spec = {
        "name": "gpu-check-window",
        "architecture": "decoder-only",
        "d_model": d_model,
        "max_seq_len": seq,
        "position": {"type": "rope"},
        "decoder": {
            "n_layers": layers,
            "attention": {"n_heads": 4 if cpu else 12, "n_kv_heads": 2 if cpu else 4, "sliding_window": seq // 4},
            "ffn": {"type": "glu", "activation": "silu", "hidden_dim": 4 * d_model},
            "norm": {"type": "rmsnorm"},
        },
    }
    rows = []
    for compiled in (False, True):
        out = folder / f"compile-{compiled}"
        out.mkdir()
        trainer = {
            "max_steps": steps,
            "val_check_interval": steps,
            "checkpoint_every_n_steps": 10 * steps,
            "log_every_n_steps": max(1, steps // 5),
            "precision": "32" if cpu else "bf16-mixed",
            "accelerator": "cpu" if cpu else "cuda",
            "devices": 1,
            "compile": compiled,
        }
        data = {"max_bytes": 300_000 if cpu else 4_000_000, "seq_len": seq, "batch_size": batch}
        path = write_recipe(out, "window", spec, data, trainer)
        rows.append(child_row(["--run-worker", str(path)], out, budget / 2, {"compile": compiled}))
        rows[-1]["compile"] = compiled
        print(f"  compile {compiled}: {rows[-1]['status']}", flush=True)
    return {"rows": rows, "ok": all(r["status"] == "ok" for r in rows)}


def run_worker(path: str, result: Path) -> None:
    """``builder train`` of one recipe file, its summary and first-step seconds to ``result``."""
    from yamlformer.recipes.training.run import run

    first = FirstStep()
    try:
        s = run(path, samples=False, callbacks=[first])
        ok = s["train_loss"] is not None and math.isfinite(s["train_loss"])
        row = {"status": "ok" if ok else "failed: loss not finite", "steps": s["steps"]}
        row.update(tokens_per_s=s["tokens_per_s"], first_step_s=first.seconds, compile_s=s["compile_seconds"])
    except Exception as exc:
        row = {"status": "failed", "error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"}
    result.write_text(json.dumps(row))


# -- yardstick: the recipe against plain PyTorch at GPT-2 small shapes --------------------------------


def gpt_shape(cpu: bool) -> dict:
    return (
        dict(n_layer=1, n_head=2, n_embd=64, block_size=32, batch=2)
        if cpu
        else dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch=16)
    )


def yardstick(cpu: bool, folder: Path, budget: float, out: Path | None = None) -> dict:
    """nanoGPT's GPT at GPT-2 small shapes (12 x 768, 12 heads, seq 1024, batch 16, no biases, no
    dropout, tied head), both compiled and in bf16: ``builder train`` (``compile: true``,
    ``bf16-mixed``, fused AdamW, clipping, its data loader) against ``benchmarks/yardstick.py``'s
    model and loop (compiled, bf16 autocast, fused AdamW, clipping, random tokens already on the
    device), same process, same vocabulary. Host syncs per recipe step counted by CUDA's sync
    debug mode over steady steps."""
    shape = gpt_shape(cpu)
    steps = 3 if cpu else 60
    spec = {
        "name": "gpt2-small-shaped",
        "architecture": "decoder-only",
        "d_model": shape["n_embd"],
        "max_seq_len": shape["block_size"],
        "tie_embeddings": True,
        "position": {"type": "learned"},
        "decoder": {
            "n_layers": shape["n_layer"],
            "attention": {"n_heads": shape["n_head"], "qkv_bias": False, "out_bias": False, "dropout": 0.0},
            "ffn": {"type": "mlp", "activation": "gelu", "hidden_dim": 4 * shape["n_embd"], "bias": False},
            "norm": {"type": "layernorm", "eps": 1.0e-5, "bias": False, "placement": "pre"},
            "final_norm": True,
            "dropout": 0.0,
        },
        "head": {"type": "lm", "bias": False},
    }
    trainer = {
        "max_steps": steps,
        "val_check_interval": 10 * steps,
        "checkpoint_every_n_steps": 10 * steps,
        "log_every_n_steps": 1 if cpu else 10,
        "precision": "32" if cpu else "bf16-mixed",
        "accelerator": "cpu" if cpu else "cuda",
        "devices": 1,
        "compile": True,
    }
    data = {"max_bytes": 300_000 if cpu else 8_000_000, "seq_len": shape["block_size"], "batch_size": shape["batch"]}
    path = write_recipe(folder, "gpt2-shaped", spec, data, trainer, optimizer={"lr": 6e-4, "weight_decay": 0.1})
    syncs = SyncCounter(first=steps // 3, last=2 * steps // 3)
    from yamlformer.builder.checkpoints import peek_meta
    from yamlformer.recipes.training.run import run

    summary = run(path, samples=False, callbacks=[syncs])
    vocab = peek_meta(Path(summary["last"]))["builder"]["spec"]["vocab_size"]
    theirs = yardstick_tokens_per_s(shape, vocab, steps, cpu)
    ours = summary["tokens_per_s"]
    row = {
        "vocab": vocab,
        "recipe_tokens_per_s": ours,
        "yardstick_tokens_per_s": theirs,
        "ratio": ours / theirs if ours and theirs else None,
        "recipe_syncs_per_step": syncs.per_step(),
    }
    return {"rows": [row], "ok": bool(ours and theirs)}


def yardstick_tokens_per_s(shape: dict, vocab: int, steps: int, cpu: bool) -> float:
    """The yardstick's GPT trained ``steps`` steps (compiled, bf16 autocast on a GPU): tokens/s
    of the median 10-step interval after the first (compilation) interval."""
    from yardstick import GPT, GPTConfig, LoopConfig, get_lr  # benchmarks/yardstick.py

    device = "cpu" if cpu else "cuda"
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=vocab,
        block_size=shape["block_size"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        n_embd=shape["n_embd"],
    )
    model = GPT(config).to(device)
    loop = LoopConfig(max_iters=steps, learning_rate=6e-4, warmup_iters=min(100, steps), lr_decay_iters=steps)
    optimizer = model.configure_optimizers(loop.weight_decay, loop.learning_rate, (loop.beta1, loop.beta2), device)
    step = torch.compile(model)
    x = torch.randint(0, vocab, (shape["batch"], shape["block_size"]), device=device)
    y = torch.randint(0, vocab, (shape["batch"], shape["block_size"]), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=not cpu)
    interval = 1 if cpu else 10
    rates, start = [], time.perf_counter()
    for it in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, loop)
        with autocast:
            _, loss = step(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), loop.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (it + 1) % interval == 0:
            loss.item()  # the interval's one sync
            now = time.perf_counter()
            rates.append(interval * shape["batch"] * shape["block_size"] / (now - start))
            start = now
    return statistics.median(rates[1:] or rates)


class SyncCounter(L.Callback):
    """Host synchronisations per training step over steps ``first`` to ``last``, counted by
    ``torch.cuda.set_sync_debug_mode`` (a warning per synchronising call); None on the CPU."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.warnings: int | None = None
        self._steps = 0
        self._recorder = self._seen = None

    def on_train_batch_start(self, trainer, pl_module, *args):
        step = trainer.global_step
        if pl_module.device.type == "cuda" and step == self.first:
            self._recorder = warnings.catch_warnings(record=True)
            self._seen = self._recorder.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        if self.first <= step < self.last:
            self._steps += 1

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self._recorder is not None and trainer.global_step == self.last:
            torch.cuda.set_sync_debug_mode("default")
            self._recorder.__exit__(None, None, None)
            self.warnings = sum("synchroniz" in str(w.message) for w in self._seen)
            self._recorder = None

    def per_step(self) -> float | None:
        return self.warnings / self._steps if self.warnings is not None and self._steps else None


# -- attention and the performance model's kernels: their own scripts ---------------------------------


def script_section(script: str, args: list[str], folder: Path, budget: float) -> dict:
    """``benchmarks/SCRIPT ARGS`` under the section's limit, its output shown; its result is the
    JSON it prints last (a list of rows, or a dict whose ``rows`` or values are)."""
    command = [sys.executable, str(REPO / "benchmarks" / script), *args]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        return {"rows": [], "ok": False, "error": f"timed out after {budget:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    sys.stdout.write("\n".join(lines[:-1][-60:]) + "\n")
    try:
        loaded = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        return {"rows": [], "ok": False, "error": (errors[-1] if errors else f"exit {done.returncode}")[:300]}
    rows = loaded if isinstance(loaded, list) else loaded.get("rows") or flat_rows(loaded)
    return {"rows": rows, "ok": done.returncode == 0, "seconds": time.perf_counter() - started}


def flat_rows(result: dict) -> list[dict]:
    """The rows of a result that holds lists of rows by name (perf_kernels' ``gemm``, ``attention``)."""
    return [{"table": name, **row} for name, rows in result.items() if isinstance(rows, list) for row in rows]


def attention(cpu: bool, folder: Path, budget: float, out: Path | None = None) -> dict:
    """``benchmarks/attention.py --sweep``: every kernel variant against SDPA's flash and cuDNN
    backends (training and decode), with the seconds its first call spent autotuning."""
    table = ["--write-table", str(out / "attention_tuning.yaml")] if out else []
    return script_section("attention.py", ["--sweep", *(["--cpu"] if cpu else []), *table], folder, budget)


def perf_kernels(cpu: bool, folder: Path, budget: float, out: Path | None = None) -> dict:
    """``benchmarks/perf_kernels.py``: the performance model's kernel efficiencies on this GPU."""
    table = ["--write", "--out", str(out)] if out else []
    return script_section("perf_kernels.py", [*(["--cpu", "--repeats", "1"] if cpu else []), *table], folder, budget)


# -- memory: the estimate against max_memory_allocated with adapters ------------------------------------


def memory(cpu: bool, folder: Path, budget: float, out: Path | None = None) -> dict:
    """``benchmarks/memory.py --adapters``: ``builder describe``'s training-memory estimate against
    ``max_memory_allocated`` for a frozen base with LoRA and with QLoRA's NF4 base (goal: within
    10%); on the CPU the same cases at a tiny spec, trained two steps, measuring nothing."""
    import memory as cases  # benchmarks/memory.py

    rows = []
    for spec_path, overrides, batch, seq, dtype, backend, ckpt in (c for c in cases.CASES if "adapters" in c[1]):
        if cpu:
            spec_path, overrides, batch, seq, dtype = (
                "specs/tiny/llama.yaml",
                {"adapters": overrides["adapters"]},
                2,
                16,
                "fp32",
            )
        row = cases.run_case(spec_path, overrides, batch, seq, dtype, backend, ckpt, device="cpu" if cpu else "cuda")
        row["adapters"] = cases.short_label(overrides["adapters"])
        row["within_10pct"] = None if row["ratio"] is None else abs(row["ratio"] - 1) <= 0.10
        rows.append(row)
    return {"rows": rows, "ok": all(r["within_10pct"] is not False for r in rows)}


#: name -> (function, seconds it may take on one H200)
SECTIONS = {
    "recipes": (recipes, 110),
    "fsdp": (fsdp, 80),
    "compile": (compile_section, 90),
    "yardstick": (yardstick, 110),
    "attention": (attention, 150),
    "perf-kernels": (perf_kernels, 45),
    "memory": (memory, 60),
}
