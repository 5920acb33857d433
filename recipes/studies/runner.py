"""``builder sweep``: a study's trials run as ordinary ``builder train`` processes, each in its own
run folder, ``parallel.trials`` at once, their results told to the study database as they end.

A trial that crashes fails with its one-line error and one that runs past ``budget.time_limit``
is killed and failed; the study goes on. A hopeless trial is stopped by the pruner (its
validation losses are read from the run's ``metrics.csv`` as it writes them). SIGINT or SIGTERM
stops the sweep: each running trial is told to stop (``builder train`` saves its checkpoint), and
is marked interrupted; the same command later runs what is left, and an interrupted trial resumes
from its checkpoint (its run folder is named by its values). Several machines sharing one storage
URL each run trials of the same study.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy.exc
from optuna.trial import TrialState

from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.studies import store
from yamlformer.recipes.studies.schema import Distribution, StudyFile
from yamlformer.recipes.studies.variants import Invalid, Variant, axis_values, check, show, train_command, trial_dir

#: seconds between looks at the running trials
POLL = 1.0
#: seconds a trial told to stop may take to save its checkpoint before it is killed
STOP_GRACE = 60.0


def read_curve(run_dir: Path, planned: int | None = None) -> tuple[list[tuple[int, float]], int]:
    """``([(step, validation loss), ...], steps trained)`` from a run's latest CSV log (Lightning
    logs step N as N - 1 during training, the last validation after it at N: ``planned``, the
    run's max_steps, bounds both)."""
    versions = sorted((run_dir / "logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    if not versions:
        return [], 0
    curve, steps = [], 0
    try:
        with versions[-1].open(newline="") as f:
            for row in csv.DictReader(f):
                step = int(row.get("step") or -1) + 1
                step = min(step, planned) if planned else step
                steps = max(steps, step)
                if row.get("val_loss"):
                    curve.append((step, float(row["val_loss"])))
    except (OSError, ValueError, csv.Error):
        pass  # a row half written: read again at the next look
    return curve, steps


def error_line(log: Path, returncode: int) -> str:
    """The one line that says why a trial's process failed: its ``builder train: ...`` line, else
    the last line of a traceback, else its exit status."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - 65536))
            lines = [line.strip() for line in f.read().decode(errors="replace").replace("\r", "\n").splitlines()]
    except OSError:
        lines = []
    lines = [line for line in lines if line]
    ours = [line for line in lines if line.startswith("builder train:")]
    if ours:
        return ours[-1]
    if any(line.startswith("Traceback") for line in lines):
        return lines[-1][:300]
    if returncode < 0:
        return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    return (lines[-1][:300] + f" (exit status {returncode})") if lines else f"exit status {returncode}"


@dataclasses.dataclass
class Running:
    """A trial's process and what the sweep knows of it."""

    trial: Any  # optuna.Trial
    variant: Variant
    process: subprocess.Popen
    log: Path
    started: float
    devices: list[str]
    reported: int = 0
    why: str | None = None  # "pruned", "time limit", "interrupted": the sweep stopped it
    told: float = 0.0  # when it was told to stop


class Sweep:
    """One worker of a study: claims trials from the study database and runs them."""

    def __init__(self, loaded: StudyFile, variants: list[Variant], study, max_trials: int | None = None, say=print):
        self.loaded, self.study, self.say = loaded, study, say
        self.settings = loaded.study
        self.planned = {v.name: v for v in variants}
        self.max_trials = max_trials
        self.started = 0
        self.running: list[Running] = []
        self.stopping = False
        self.ready = False  # whether the trials' shared data is made (see _slots)
        slots, per = self.settings.parallel.trials, self.settings.parallel.devices
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        pool = visible.split(",") if visible else [str(i) for i in range(slots * per)]
        self.free_devices = pool
        self.threads = max(1, (os.cpu_count() or 1) // slots)

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Run trials until none is left, a budget is spent or a signal stops it; returns the
        exit status (130 when stopped by a signal)."""
        previous = {sig: signal.signal(sig, self._signalled) for sig in (signal.SIGINT, signal.SIGTERM)}
        beating = threading.Event()
        threading.Thread(target=self._beat, args=(beating,), name="heartbeats", daemon=True).start()
        try:
            while not self.stopping:
                self._look()
                while not self.stopping and len(self.running) < self._slots() and self._start_next():
                    pass
                if not self.running and not self.stopping:
                    break
                time.sleep(POLL)
        finally:
            self._stop_all()
            beating.set()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 130 if self.stopping else 0

    def _beat(self, done: threading.Event) -> None:
        """Prove each running trial alive every third of a heartbeat, from a thread of its own
        (as ``study.optimize`` does): the loop waits on a finished trial's downstream evaluation
        for minutes, and a worker starting meanwhile fails every trial silent for GRACE."""
        while not done.wait(store.HEARTBEAT / 3):
            for r in list(self.running):
                try:
                    store.heartbeat(self.study, r.trial)
                except sqlalchemy.exc.SQLAlchemyError:
                    pass  # the database locked past its timeout: the next beat tries again

    def _slots(self) -> int:
        """Trials that may run now: one until a trial of this sweep has trained a step (its corpus
        tokenized and its tokenizer made, into the cache every trial shares), then all of them."""
        if not self.ready:
            self.ready = any(read_curve(trial_dir(self.loaded, r.variant.name))[1] for r in self.running)
        return self.settings.parallel.trials if self.ready else 1

    def _signalled(self, signum, frame) -> None:
        if self.stopping:  # a second signal: stop waiting for checkpoints
            for r in self.running:
                _kill(r.process, signal.SIGKILL)
            return
        self.stopping = True
        self.say(f"\n{signal.Signals(signum).name}: stopping; running trials save their checkpoints and resume later")

    # -- starting trials --------------------------------------------------------------------------

    def _start_next(self) -> bool:
        """Claim and start one trial; ``False`` when there is none to start now."""

        if self.max_trials is not None and self.started >= self.max_trials:
            return False
        if self._spent():
            return False
        waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if not waiting and (self.settings.search == "grid" or self._drawn() >= self.settings.total.trials):
            return False
        trial = self.study.ask()
        if self.settings.search == "grid" and "variant" not in trial.user_attrs:
            self.study.tell(trial, state=TrialState.FAIL)  # another worker took the last one: no variant, not shown
            return False
        self.started += 1
        trial.set_user_attr("worker", store.worker())
        values = self._values(trial)
        try:
            variant = self.planned.get(trial.user_attrs.get("variant")) or check(self.loaded, values)
        except RecipeError as exc:
            record_invalid(self.study, Invalid(trial.user_attrs.get("variant", ""), values, str(exc)), trial)
            self.say(f"trial {trial.number}: cannot run: {str(exc).splitlines()[0]}")
            return True
        self._launch(trial, variant)
        return True

    def _values(self, trial) -> dict[str, Any]:
        """The trial's axis values: a queued trial's fixed ones, else drawn by the sampler."""
        values = {}
        for axis, choices in axis_values(self.loaded).items():
            spec = self.settings.axes.get(axis)
            if isinstance(spec, Distribution):
                suggest = trial.suggest_int if spec.integer else trial.suggest_float
                low, high = (int(spec.low), int(spec.high)) if spec.integer else (spec.low, spec.high)
                values[axis] = suggest(axis, low, high, log=spec.log)
            else:
                encoded = [store.encode(c) for c in choices]
                values[axis] = choices[encoded.index(trial.suggest_categorical(axis, encoded))]
        return values

    def _launch(self, trial, variant: Variant) -> None:
        attrs = describe_variant(variant)
        attrs["run_dir"] = str(trial_dir(self.loaded, variant.name).resolve())
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        run_dir = Path(attrs["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        devices = [self.free_devices.pop(0) for _ in range(self.settings.parallel.devices)]
        env = dict(os.environ, TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        else:
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
        log = run_dir / "trial.log"
        with log.open("ab") as out:
            out.write(f"\n=== trial {trial.number} ({store.worker()}, {time.ctime()})\n".encode())
            out.flush()
            process = subprocess.Popen(
                train_command(self.loaded, variant, self.settings.parallel.devices),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # a Ctrl-C reaches the sweep, which tells each trial itself
            )
        self.running.append(Running(trial, variant, process, log, time.time(), devices))
        steps = f"{variant.steps:,} steps" if variant.steps is not None else f"{variant.budget['minutes']:g} min"
        self.say(
            f"trial {trial.number} start: {variant.name} ({variant.params:,} params, "
            f"{variant.flops_per_token:,} FLOPs/token, {steps})"
        )

    def _drawn(self) -> int:
        """Trials a search has drawn (one per variant value set, an interrupted one counted once)."""
        return len(store.latest_trials(self.study))

    def _spent(self) -> bool:
        """Whether the study's total minutes or FLOPs are used up (no new trial then)."""
        total = self.settings.total
        if total.minutes is None and total.flops is None:
            return False
        trials = store.latest_trials(self.study)
        now = time.time()
        minutes = sum(t.user_attrs.get("wall_s", 0) for t in trials) / 60
        minutes += sum(now - r.started for r in self.running) / 60
        flops = sum(t.user_attrs.get("flops") or t.user_attrs.get("planned_flops") or 0 for t in trials)
        return bool(
            (total.minutes is not None and minutes >= total.minutes)
            or (total.flops is not None and flops >= total.flops)
        )

    # -- watching trials --------------------------------------------------------------------------

    def _look(self) -> None:
        now = time.time()
        for r in list(self.running):
            self._report(r)
            limit = self.settings.budget.time_limit
            if r.why is None and limit is not None and now - r.started > limit * 60:
                self._tell_stop(r, "time limit")
            if r.why is not None and now - r.told > STOP_GRACE / (4 if r.why == "time limit" else 1):
                _kill(r.process, signal.SIGKILL)
            if r.process.poll() is not None:
                self.ready = self.ready or r.process.returncode == 0
                self.running.remove(r)
                self.free_devices += r.devices
                self._finish(r)

    def _report(self, r: Running) -> None:
        """Tell the study each new validation loss; stop the trial when the pruner says so."""
        curve, _ = read_curve(trial_dir(self.loaded, r.variant.name), r.variant.steps)
        for index in range(r.reported, len(curve)):
            r.trial.report(curve[index][1], step=index + 1)
        if len(curve) > r.reported and r.why is None and self.settings.pruner is not None:
            if self.settings.pruner.type != "none" and r.trial.should_prune():
                self._tell_stop(r, "pruned")
        r.reported = max(r.reported, len(curve))

    def _tell_stop(self, r: Running, why: str) -> None:
        r.why, r.told = why, time.time()
        _kill(r.process, signal.SIGTERM)

    def _finish(self, r: Running) -> None:

        trial, variant = r.trial, r.variant
        curve, steps = read_curve(trial_dir(self.loaded, variant.name), variant.steps)
        wall = time.time() - r.started + earlier_wall(self.study, trial)
        results = {"wall_s": round(wall, 1), "curve": curve, "steps": steps}
        if curve:
            tokens = steps * variant.tokens_per_step
            results.update(
                final_val=curve[-1][1],
                best_val=min(v for _, v in curve),
                tokens=tokens,
                flops=float(tokens) * variant.flops_per_token,
            )
        state, value, line = TrialState.FAIL, None, None
        if r.why == "interrupted" and r.process.returncode == 0 and curve and steps >= (variant.steps or 0):
            r.why = None  # it ended on its own as it was told to stop
        if r.why == "interrupted":
            results["interrupted"] = True
            line = "interrupted; resumes at the next sweep"
        elif r.why == "time limit":
            results["error"] = f"ran past its time limit of {self.settings.budget.time_limit:g} min; killed"
        elif r.why == "pruned":
            state, value = TrialState.PRUNED, results.get("final_val")
            line = f"pruned at validation {len(curve)} (val loss {value:.4f})" if value is not None else "pruned"
        elif r.process.returncode != 0:
            results["error"] = error_line(r.log, r.process.returncode)
        elif not curve:
            results["error"] = "the run ended without a validation loss (see trial.log)"
        else:
            state, value = TrialState.COMPLETE, results["final_val"]
            line = f"val loss {value:.4f} after {steps:,} steps, {wall:.0f} s"
        for key, item in results.items():
            trial.set_user_attr(key, item)
        if state == TrialState.COMPLETE and self.settings.downstream is not None:
            line += downstream(self.loaded, trial, Path(trial.user_attrs["run_dir"]))
        self.study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        shown = store.status(self.study.trials[trial.number])
        self.say(f"trial {trial.number} {shown}: {variant.name}: {line or results.get('error')}")

    def _stop_all(self) -> None:
        """Tell every running trial to stop, wait for its checkpoint, and mark it interrupted."""
        for r in self.running:
            if r.why is None and r.process.poll() is None:
                self._tell_stop(r, "interrupted")
        deadline = time.time() + STOP_GRACE
        while self.running:
            for r in list(self.running):
                if r.process.poll() is not None or time.time() > deadline:
                    if r.process.poll() is None:
                        _kill(r.process, signal.SIGKILL)
                        r.process.wait()
                    self.running.remove(r)
                    self._finish(r)
            time.sleep(0.2)


def _kill(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the trial and what it started (batch workers, torchrun ranks)
    except (ProcessLookupError, PermissionError):
        pass


def earlier_wall(study, trial) -> float:
    """Seconds an interrupted predecessor of a resumed trial already ran."""
    number = trial.user_attrs.get("resumes")
    return study.trials[number].user_attrs.get("wall_s", 0.0) if number is not None else 0.0


def describe_variant(variant: Variant) -> dict[str, Any]:
    """What a trial records of its variant before it runs."""
    return {
        "variant": variant.name,
        "values": {k: show(v) if isinstance(v, (dict, list)) else v for k, v in variant.values.items()},
        "family": variant.family,
        "params": variant.params,
        "non_embedding": variant.non_embedding,
        "flops_per_token": variant.flops_per_token,
        "tokens_per_step": variant.tokens_per_step,
        "planned_steps": variant.steps,
        "planned_flops": variant.flops,
        "budget": variant.budget,
    }


def record_invalid(study, bad: Invalid, trial=None) -> None:
    """A variant that cannot run, kept as a failed trial with its error (the report lists it)."""

    trial = trial or study.ask()
    for key, value in {"variant": bad.name, "values": bad.values, "error": bad.error, "invalid": True}.items():
        trial.set_user_attr(key, value)
    study.tell(trial, state=TrialState.FAIL)


def queue_grid(study, variants: list[Variant], invalid: list[Invalid]) -> None:
    """A new grid study: its impossible variants recorded, then every other one queued."""
    for bad in invalid:
        record_invalid(study, bad)
    for variant in variants:
        params = {axis: store.encode(value) for axis, value in variant.values.items()}
        study.enqueue_trial(params, user_attrs={"variant": variant.name})


def downstream(loaded: StudyFile, trial, run_dir: Path) -> str:
    """Score a finished trial's best checkpoint on the study's downstream tasks (``builder eval
    --tasks``, in a process of its own) and record the metrics; returns the line's addition."""

    settings = loaded.study.downstream
    command = [sys.executable, "-m", "yamlformer.builder.cli", "eval", str(run_dir / "checkpoints" / "best.ckpt")]
    command += ["--tasks", ",".join(settings.tasks), "--json"]
    if settings.include:
        command += ["--task-path", str(loaded.path.resolve().parent / settings.include)]
    if settings.limit:
        command += ["--limit", str(settings.limit)]
    if settings.num_fewshot is not None:
        command += ["--num-fewshot", str(settings.num_fewshot)]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
    if done.returncode != 0:
        line = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        trial.set_user_attr("downstream_error", line)
        return f"; downstream failed: {line}"
    metrics = json.loads(done.stdout.strip().splitlines()[-1]).get("harness", {})
    trial.set_user_attr("downstream", metrics)
    return "; " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
