"""Training from tokenized datasets of different sizes, side by side: start-up before the first
step, peak RSS of the whole process tree and the share of each step spent waiting for data.

Each dataset trains the default recipe's model (recipes/lm-stdlib.yaml, its tokenizer replaced by
the dataset's) for ``--steps`` steps in a fresh process. Data time is the main process's wait in
the data loader's ``next()`` (the batch is made ahead in a worker), median over the steps; "gap"
is everything between one step's end and the next one's start (that wait plus Lightning's own
bookkeeping: an upper bound). Start-up is from the process's start to the first step's start.
The corpus-size question is answered by the ratio of peak RSS between the datasets.

    python benchmarks/tokenize_corpus.py --gb 5 --work /tmp/tokbench --keep   # makes /tmp/tokbench/ours
    python benchmarks/train_from_dataset.py /tmp/tokbench/small.tok /tmp/tokbench/ours --steps 60
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P

REPO = Path(__file__).resolve().parents[1]
STARTED = time.perf_counter()


def tree_rss(pid: int) -> int:
    import psutil

    try:
        parent = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
    except psutil.Error:
        return 0


def worker(dataset: str, steps: int, settings: list[str], queue) -> None:
    import lightning as L

    from yamlformer.builder.spec.loader import parse_set_args
    from yamlformer.recipes.training.run import run

    times: dict = {"ends": [], "starts": [], "first": None}

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            now = time.perf_counter()
            times["first"] = times["first"] or now - STARTED
            times["starts"].append(now)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            times["ends"].append(time.perf_counter())

    import yamlformer.recipes.training.run

    made = yamlformer.recipes.training.run.run_trainer

    def with_clock(recipe, recipe_file, spec, out, callbacks, ckpt):
        return made(recipe, recipe_file, spec, out, [Clock(), *callbacks], ckpt)

    yamlformer.recipes.training.run.run_trainer = with_clock
    prepared = yamlformer.recipes.training.run.prepare

    def timed_prepare(*args, **kwargs):  # opening the corpus: manifests, checksums, memory maps
        began = time.perf_counter()
        try:
            return prepared(*args, **kwargs)
        finally:
            times["open_s"] = time.perf_counter() - began

    yamlformer.recipes.training.run.prepare = timed_prepare
    from torch.utils.data import dataloader

    fetches: list[float] = []
    for iterator in (dataloader._MultiProcessingDataLoaderIter, dataloader._SingleProcessDataLoaderIter):

        def timed_next(self, _next=iterator.__next__):  # the main process's wait for a batch
            began = time.perf_counter()
            try:
                return _next(self)
            finally:
                fetches.append(time.perf_counter() - began)

        iterator.__next__ = timed_next
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="train-from-dataset-") as tmp:
        overrides = {
            "data.sources": [dataset],
            "data.dataset": None,
            "trainer.max_steps": steps,
            "trainer.max_time": None,
            "trainer.val_check_interval": steps,
            "trainer.limit_val_batches": 2,
            "trainer.checkpoint_every_n_steps": steps,
            "trainer.output_dir": tmp,
            "data.cache_dir": str(Path(tmp) / "cache"),
            **parse_set_args(settings),
        }
        run(REPO / "recipes" / "lm-stdlib.yaml", overrides=overrides, samples=False)
    starts, ends = times["starts"], times["ends"]
    waits = [s - e for e, s in zip(ends[:-1], starts[1:])]  # from a step's end to the next one's start
    steps_s = [e - s for s, e in zip(starts[1:], ends[1:])]
    queue.put(
        {
            "fetch_s": statistics.median(fetches[5:] or fetches),
            "first_step_s": times["first"],
            "open_s": times["open_s"],
            "run_to_first_step_s": times["first"] - (began - STARTED),
            "wait_s": statistics.median(waits[5:] or waits),
            "step_s": statistics.median(steps_s[5:] or steps_s),
        }
    )


def measure(dataset: str, steps: int, settings: list[str]) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=worker, args=(dataset, steps, settings, queue))
    process.start()
    peak = 0
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(process.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = queue.get()
    process.join()
    done.set()
    sampler.join()
    size = sum(f.stat().st_size for f in Path(dataset).rglob("*.bin"))
    return {"dataset": dataset, "token_bytes": size, "peak_rss_bytes": peak, **result}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("datasets", nargs="+", help="tokenized dataset folders (builder tokenize outputs)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    sys.path.append(str(REPO / "benchmarks"))  # imported by a test as well as run as a script
    from machine import emit, machine

    rows = [measure(d, args.steps, args.set) for d in args.datasets]
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    print(
        f"{'dataset':<40} {'token bytes':>12} {'process s':>9} {'run s':>6} {'open s':>6} {'peak RSS':>10} "
        f"{'step ms':>8} {'data ms':>8} {'share':>6} {'gap ms':>7}"
    )
    print("  process s: process start to the first step (imports included); run s: from `run()`; open s: the corpus")
    for r in rows:
        print(
            f"{r['dataset'][-40:]:<40} {r['token_bytes'] / 1e9:>10.2f}GB {r['first_step_s']:>9.2f} "
            f"{r['run_to_first_step_s']:>6.2f} {r['open_s']:>6.2f} "
            f"{r['peak_rss_bytes'] / 2**30:>8.2f}GB {r['step_s'] * 1e3:>8.1f} {r['fetch_s'] * 1e3:>8.3f} "
            f"{r['fetch_s'] / r['step_s']:>6.2%} {r['wait_s'] * 1e3:>7.2f}"
        )
    if len(rows) > 1:
        print(
            f"peak RSS of the largest over the smallest dataset: "
            f"{rows[-1]['peak_rss_bytes'] / rows[0]['peak_rss_bytes']:.2f}x for "
            f"{rows[-1]['token_bytes'] / rows[0]['token_bytes']:.1f}x the tokens"
        )
    return emit({"machine": machine(), "steps": args.steps, "rows": rows}, args.json)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
