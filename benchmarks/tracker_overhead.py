"""What logging to MLflow and to Weights & Biases adds to a training step, on the CPU.

    python benchmarks/tracker_overhead.py [--steps 300] [--seeds 3] [--log-every 10]

``builder train``'s whole loop on step_overhead.py's tiny decoder (1 layer, d_model 32, batch 4 x
32, one thread: a step of a few milliseconds, where anything the trackers add shows), at the
default log interval (``trainer.log_every_n_steps: 10``), in one process, for each seed in turn:

* ``csv only``: the CSV log alone (TensorBoard off), the baseline;
* ``+ mlflow``: also MLflow, to a real ``mlflow server`` on a loopback port (sqlite store) that
  this script starts and stops;
* ``+ wandb offline``: also W&B in offline mode (its own service process writes the run files).

A step's time is the wall time between consecutive training batch ends. The cost of a log falls
on one step in ``--log-every``, so a run's number is the median, over its log intervals (each
``--log-every`` steps with one log step), of the interval's mean step: the log's cost is in every
interval, a busy machine's stray pause in few (the first fifth of the steps left out: start-up,
the tracker's run being created). The table shows the median over seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead import StepClock, recipe_file  # the benchmark beside this one


def start_mlflow(root: Path) -> tuple[subprocess.Popen, str]:
    """``mlflow server`` on a free loopback port with its store under ``root``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", str(root / "art")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its workers die with it (stop_mlflow)
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"http://127.0.0.1:{port}"
        time.sleep(0.2)
    stop_mlflow(server)
    raise SystemExit("mlflow server did not start")


def stop_mlflow(server: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(10)


def configured(folder: Path, steps: int, log_every: int, seed: int, loggers: dict) -> Path:
    """step_overhead's recipe with these loggers, this seed and log interval, in its own folder."""
    folder.mkdir(parents=True, exist_ok=True)
    path = recipe_file(folder, steps, 1)
    doc = yaml.safe_load(path.read_text())
    doc["trainer"].update(log_every_n_steps=log_every, seed=seed, loggers={"tensorboard": False, **loggers})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def interval_ms(path: Path, log_every: int) -> float:
    """Milliseconds per step of the run: the median over its log intervals (``log_every``
    consecutive steps, one log step in each) of the interval's mean step."""
    from yamlformer.recipes.training.run import run

    clock = StepClock()
    run(path, fresh=True, samples=False, callbacks=[clock])
    kept = clock.seconds[len(clock.seconds) // 5 :]
    windows = [kept[i : i + log_every] for i in range(0, len(kept) - log_every + 1, log_every)]
    return statistics.median(statistics.fmean(w) for w in windows) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds, each running every configuration (default 3)")
    parser.add_argument("--log-every", type=int, default=10, help="trainer.log_every_n_steps (default 10, the default)")
    args = parser.parse_args(argv)
    if args.steps < 20 or args.seeds < 1 or args.log_every < 1:
        parser.error("--steps must be at least 20, --seeds and --log-every at least 1")
    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_SILENT", "true")
    results: dict[str, list[float]] = {"csv only": [], "+ mlflow": [], "+ wandb offline": []}
    with tempfile.TemporaryDirectory(prefix="trackers-") as tmp:
        server, uri = start_mlflow(Path(tmp) / "mlflow")
        try:
            loggers = {
                "csv only": {},
                "+ mlflow": {"mlflow": {"tracking_uri": uri, "experiment": "overhead"}},
                "+ wandb offline": {"wandb": {"offline": True, "project": "overhead"}},
            }
            for seed in range(1, args.seeds + 1):
                for n, (name, chosen) in enumerate(loggers.items()):
                    folder = Path(tmp) / f"seed{seed}-{n}"
                    path = configured(folder, args.steps, args.log_every, seed, chosen)
                    results[name].append(interval_ms(path, args.log_every))
        finally:
            stop_mlflow(server)
    base = statistics.median(results["csv only"])
    print(f"\n{args.steps} steps a run, log every {args.log_every}, {args.seeds} seeds, torch {torch.__version__}")
    print("| loggers | ms per step (median of seeds) | per seed | over csv only |\n|---|---:|---|---:|")
    for name, values in results.items():
        ms = statistics.median(values)
        seeds = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {ms:.2f} | {seeds} | {ms - base:+.3f} ms ({(ms / base - 1) * 100:+.1f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
