"""What logging to MLflow and to Weights & Biases costs a training step, on the CPU.

    python benchmarks/tracker_overhead.py [--seeds 5] [--shape both] [--log-every 10]

``builder train``'s whole loop at the default log interval (``trainer.log_every_n_steps: 10``),
torch on one thread, in one process, each seed running every configuration in turn:

* ``csv only``: the CSV log alone (TensorBoard off), the baseline;
* ``+ mlflow``: also MLflow, to a real ``mlflow server`` on a loopback port (sqlite store) that
  this script starts and stops;
* ``+ wandb offline``: also W&B in offline mode (its own service process writes the run files).

Two shapes: ``tiny``, step_overhead.py's decoder (1 layer, d_model 32: a step of a few ms, where
anything a tracker adds shows) and ``lm``, the default recipe's model (recipes/lm-stdlib.yaml:
4 layers, d_model 192, batch 16 x 128, its BPE tokenizer), shortened to a few dozen steps.

On a shared machine the wall time of one configuration varies by more than the 1% a tracker may
add, so two things are measured that such noise does not hide, over the run's steps after its
first fifth, the trackers having created their tracked run and sent its params (training waits
for that at its start, :class:`Meter`: start-up is not a step's cost):

* ``in calls``: the time the training thread spends inside the tracker's calls (``log_metrics``,
  timed with ``perf_counter`` in this process), as % of that stretch's wall time: what training
  waits for;
* ``bound``: the CPU time the tracker's own thread (``time.pthread_getcpuclockid``) and, for W&B,
  its service process (psutil: this process's children but the MLflow server) used meanwhile, as %
  of the same wall time: what the tracker could take from training where it competes for the
  cores (on a machine with a core to spare it takes nothing). The MLflow server's own CPU is not
  counted: it runs elsewhere in a real setup; W&B's service is ended after each W&B run
  (``wandb.teardown``), so no other run counts it.

Each run's numbers are printed per seed; the table shows the median over seeds, and the wall ms
per step (the median step) of each configuration for scale. ``csv only`` is the control: nothing
of a tracker runs there, so its two columns read 0.
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

import lightning as L
import psutil
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead import REPO, recipe_file  # the benchmark beside this one

#: the shapes and the steps of a run of each by default
SHAPES = ("tiny", "lm")
STEPS = {"tiny": 2000, "lm": 60}
#: seconds a run waits at its start for the trackers to send its params and settle (Meter)
SETTLE_SECONDS = 5.0


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


def lm_recipe(folder: Path, steps: int) -> Path:
    """recipes/lm-stdlib.yaml's model, tokenizer and batch, shortened: ``steps`` steps on 2 MB of
    its corpus (the tokenizer trained once, in ``folder``'s shared cache), no validation."""
    doc = yaml.safe_load((REPO / "recipes" / "lm-stdlib.yaml").read_text())
    doc["data"].update(max_bytes=2_000_000, num_workers=0, cache_dir=str(folder.parent / "cache"))
    doc["trainer"].update(
        max_steps=steps,
        max_time=None,
        val_check_interval=10 * steps,
        checkpoint_every_n_steps=10 * steps,
        limit_val_batches=1,
        accelerator="cpu",
        precision="32",
        devices=1,
        output_dir=str(folder / "run"),
    )
    doc["sample"] = {"max_new_tokens": 0}
    path = folder / "lm.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def configured(shape: str, folder: Path, steps: int, log_every: int, seed: int, loggers: dict) -> Path:
    """The shape's recipe with these loggers, this seed and log interval, in its own folder."""
    folder.mkdir(parents=True, exist_ok=True)
    path = recipe_file(folder, steps, 0) if shape == "tiny" else lm_recipe(folder, steps)
    doc = yaml.safe_load(path.read_text())
    doc["trainer"].update(log_every_n_steps=log_every, seed=seed, loggers={"tensorboard": False, **loggers})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cpu_seconds(process: psutil.Process) -> float:
    with contextlib.suppress(psutil.Error):
        times = process.cpu_times()
        return times.user + times.system
    return 0.0


class Meter(L.Callback):
    """Over the steps after the first ``skip``: each step's wall time, the training thread's time
    inside the trackers' ``log_metrics`` calls, and the CPU time of the trackers' threads and of
    this process's children (but ``server``) from the end of step ``skip`` to the last step's."""

    def __init__(self, skip: int, steps: int, server: int):
        self.skip, self.steps, self.server = skip, steps, server
        self.step_seconds: list[float] = []
        self.in_calls = 0.0
        self.trackers: list = []
        self._last: float | None = None
        self._cpu_first = self._cpu_last = (0.0, 0.0)

    def _timed(self, call):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                if self._last is not None:  # the measured stretch
                    self.in_calls += time.perf_counter() - started

        return timed

    def on_train_start(self, trainer, pl_module):
        """Times the trackers' ``log_metrics``, then waits until each has started its tracked run
        and sent the run's params (and W&B's service has settled): start-up is not a step's cost."""
        self.trackers = [logger for logger in trainer.loggers if hasattr(logger, "thread")]  # trackers.Background
        for logger in self.trackers:
            logger.log_metrics = self._timed(logger.log_metrics)
        deadline = time.monotonic() + 120
        while any(t.tracker is None and t.failed is None for t in self.trackers) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.trackers:
            time.sleep(SETTLE_SECONDS)

    def _tracker_cpu(self) -> tuple[float, float]:
        """CPU seconds so far of (the trackers' threads, this process's children but the server)."""
        threads = sum(time.clock_gettime(time.pthread_getcpuclockid(t.thread.ident)) for t in self.trackers)
        skipped = {self.server, *(p.pid for p in _descendants(self.server))}
        children = [p for p in psutil.Process().children(recursive=True) if p.pid not in skipped]
        return threads, sum(cpu_seconds(p) for p in children)

    def on_train_batch_end(self, trainer, *args):
        now = time.perf_counter()
        if self._last is not None:
            self.step_seconds.append(now - self._last)
        if trainer.global_step == self.skip:
            self._last, self._cpu_first = now, self._tracker_cpu()
        elif self._last is not None:
            self._last = now
        if trainer.global_step == self.steps:
            self._cpu_last = self._tracker_cpu()

    def percents(self) -> tuple[float, float, float]:
        """(in calls, the trackers' threads' CPU, other processes' CPU), % of the measured stretch's wall time."""
        wall = sum(self.step_seconds)
        threads, processes = (b - a for a, b in zip(self._cpu_first, self._cpu_last))
        return self.in_calls / wall * 100, threads / wall * 100, processes / wall * 100


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def measured(path: Path, steps: int, server: int) -> tuple[float, float, float, float]:
    """(median ms per step, in calls %, bound %, of it other processes %) of one run of ``path``."""
    from yamlformer.recipes.training.run import run

    meter = Meter(steps // 5, steps, server)
    with open(path.with_suffix(".log"), "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        run(path, fresh=True, samples=False, callbacks=[meter])
    if any(t.failed for t in meter.trackers):
        raise SystemExit(f"{path}: a tracker failed: {[t.failed for t in meter.trackers]}")
    calls, threads, processes = meter.percents()
    return statistics.median(meter.step_seconds) * 1e3, calls, threads + processes, processes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=(*SHAPES, "both"), default="both", help="the model shape (default both)")
    parser.add_argument("--steps", type=int, help=f"steps per run (default {STEPS})")
    parser.add_argument("--seeds", type=int, default=3, help="seeds, each running every configuration (default 3)")
    parser.add_argument("--log-every", type=int, default=10, help="trainer.log_every_n_steps (default 10, the default)")
    args = parser.parse_args(argv)
    if (args.steps is not None and args.steps < 20) or args.seeds < 1 or args.log_every < 1:
        parser.error("--steps must be at least 20, --seeds and --log-every at least 1")
    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_SILENT", "true")
    shapes = SHAPES if args.shape == "both" else (args.shape,)
    names = ("csv only", "+ mlflow", "+ wandb offline")
    results = {(shape, name): [] for shape in shapes for name in names}
    with tempfile.TemporaryDirectory(prefix="trackers-") as tmp:
        server, uri = start_mlflow(Path(tmp) / "mlflow")
        try:
            loggers = dict(
                zip(names, ({}, {"mlflow": {"tracking_uri": uri, "experiment": "overhead"}},
                            {"wandb": {"offline": True, "project": "overhead"}}))
            )  # fmt: skip
            for shape in shapes:
                steps = args.steps or STEPS[shape]
                for seed in range(1, args.seeds + 1):
                    for n, name in enumerate(names):
                        folder = Path(tmp) / shape / f"seed{seed}-{n}"
                        path = configured(shape, folder, steps, args.log_every, seed, loggers[name])
                        results[shape, name].append(measured(path, steps, server.pid))
                        if "wandb" in loggers[name]:  # its service process ends with its run, not in the next
                            import wandb

                            wandb.teardown()
                        ms, calls, bound, processes = results[shape, name][-1]
                        print(
                            f"{shape} seed {seed} {name}: {ms:.2f} ms/step, in calls {calls:.3f}%,"
                            f" bound {bound:.2f}% (other processes {processes:.2f}%)",
                            flush=True,
                        )
        finally:
            stop_mlflow(server)
    print(f"\nlog every {args.log_every}, {args.seeds} seeds, torch {torch.__version__}, one thread")
    print(
        "| shape | loggers | ms per step | in calls, % of step | per seed | bound, % of step | per seed"
        " | of the bound, other processes |"
    )
    print("|---|---|---:|---:|---|---:|---|---:|")
    for (shape, name), runs in results.items():
        ms, calls, bound, processes = (statistics.median(column) for column in zip(*runs))
        each = [", ".join(f"{run[i]:.{digits}f}" for run in runs) for i, digits in ((1, 3), (2, 2))]
        row = f"| {shape} | {name} | {ms:.2f} | {calls:.3f} | {each[0]} | {bound:.2f} | {each[1]} | {processes:.2f} |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
