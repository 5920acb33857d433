"""The trackers a recipe names (``trainer.loggers.wandb``, ``.mlflow``): Lightning's own
``WandbLogger`` and ``MLFlowLogger``, each behind :class:`Background`, so a tracking server that is
down, slow or dies mid-run never stops or stalls training (one warning; the CSV keeps everything).

Their run ids are kept in the run folder (``trackers.json``): a resumed run writes into the same
tracked run, ``--fresh`` starts a new one, and a run started from another run folder's checkpoint
(a ``--cooldown-from`` branch) is a child run naming that folder's tracked run as its parent.
Only global rank 0 logs.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

from yamlformer.builder.spec.problems import locate
from yamlformer.builder.spec.source import Document, Problem, SpecError
from yamlformer.recipes.data.files import write_atomic
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.say import say

TRACKERS = "trackers.json"
#: seconds a run's end waits for a tracker to take what is queued
FLUSH_SECONDS = 30.0
#: seconds a tracker's thread gathers the calls made after the first it has not sent, then sends
#: them together: a log step's several ``log_metrics`` calls (the loss, the throughput, the
#: learning rate and memory) are one request, and a run of short steps wakes the thread once a
#: second instead of once a call; a metric reaches the dashboard at most this much later
GATHER_SECONDS = 1.0
#: MLflow's own retry settings, unless the environment sets them: a request to a server that is
#: down gives up after about 4 s (2 retries, 1 s and 2 s apart) and one that hangs after 10 s a
#: try, where MLflow's defaults (7 retries, a factor of 2, 120 s) keep a dead server's run busy for
#: minutes, past :data:`FLUSH_SECONDS`
MLFLOW_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


def stored_ids(folder: Path) -> dict[str, Any]:
    """The tracked run ids a run folder holds (empty when it holds none, or a damaged file)."""
    with contextlib.suppress(OSError, ValueError):
        found = json.loads((Path(folder) / TRACKERS).read_text())
        if isinstance(found, dict):
            return found
    return {}


_lock = threading.Lock()


def store_id(folder: Path, tracker: str, ids: dict[str, Any]) -> None:
    with _lock:
        found = stored_ids(folder)
        found[tracker] = ids
        write_atomic(Path(folder) / TRACKERS, json.dumps(found, indent=1).encode())


def _missing(extra: str, module: str) -> str | None:
    """Why the optional client package ``module`` cannot be used (``None`` when it can)."""
    try:
        __import__(module)
    except ImportError:
        return f"the {module} package is not installed: pip install 'yamlformer[{extra}]'"
    return None


def _client(extra: str, module: str) -> None:
    """The optional client package is there, or one line naming the extra to install."""
    if (why := _missing(extra, module)) is not None:
        raise RecipeError(f"trainer.loggers.{extra}: {why}")


def check_clients(loggers, written: Document | None = None) -> None:
    """Before any work: each tracker ``loggers`` (the recipe's ``trainer.loggers``) names has its
    client package, else one line at the recipe's line of that field (``written``: the recipe
    file as written, :attr:`yamlformer.recipes.recipe.located.LocatedRecipe.written`) naming the
    extra that installs it."""
    for key in MAKERS:
        if getattr(loggers, key) is None or (why := _missing(key, key)) is None:
            continue
        if written is None:
            raise RecipeError(f"trainer.loggers.{key}: {why}")
        doc, field = written, ("trainer", "loggers", key)
        mark = doc.key_mark(field)  # the `wandb:` line (its value may be a block below it)
        raise SpecError([Problem.at(mark, field, why) if mark else locate(doc, field, why)])  # else: --set's


class _OffTrackerThreads(logging.Filter):
    """Drops the records a tracker's thread logs: urllib3's "Retrying ..." line for each retry of
    each request to a server that is down would be many warnings; the tracker says one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.threadName.startswith("tracker-")


_QUIET = _OffTrackerThreads()


class Background(Logger):
    """A Lightning logger whose calls run in order on a thread of their own, so training never
    waits for the network: a call only appends to a list. The thread sends what came in for
    :data:`GATHER_SECONDS` at once (:func:`merged`: the ``log_metrics`` calls as one ``log_steps``
    call of the made tracker, a row a step). The
    first error is one warning and the tracker is dropped for the rest of the run; :meth:`close`
    sends what is left, waiting at most :data:`FLUSH_SECONDS`."""

    def __init__(self, label: str, make, flush_seconds: float = FLUSH_SECONDS, gather_seconds: float = GATHER_SECONDS):
        super().__init__()
        self.label, self._make = label, make
        self.flush_seconds, self.gather_seconds = flush_seconds, gather_seconds
        self.failed: str | None = None
        self.tracker: Logger | None = None
        self._calls: collections.deque = collections.deque()  # appended on training's thread, taken on this one
        self._wake = threading.Event()  # a call is waiting
        self._closing = threading.Event()  # no more calls: send what is left now
        self._done = threading.Event()
        #: the thread that talks to the tracker (benchmarks/tracker_overhead.py reads its CPU time)
        self.thread = threading.Thread(target=self._work, name=f"tracker-{label}", daemon=True)
        self.thread.start()

    @property
    def name(self) -> str:
        return self.label

    @property
    def version(self) -> str:
        return "0"

    def _fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            say(f"warning: {self.label}: {self.failed}; the run goes on without it (the CSV log keeps every metric)")

    def _work(self) -> None:
        logging.getLogger("urllib3.connectionpool").addFilter(_QUIET)  # once: a filter is added once
        try:
            self.tracker = self._make()
        except BaseException as exc:
            self._fail(exc)
        while self._calls or not self._closing.is_set():
            self._wake.wait()
            self._closing.wait(self.gather_seconds)  # what comes in meanwhile goes in the same send
            self._wake.clear()  # before taking: a call appended after it wakes the next round
            calls = [self._calls.popleft() for _ in range(len(self._calls))]
            for method, args in merged(calls):
                if self.failed is None:
                    try:
                        getattr(self.tracker, method)(*args)
                    except BaseException as exc:
                        self._fail(exc)
        self._done.set()

    def _put(self, method: str, *args) -> None:
        if self.failed is None and not self._closing.is_set():
            self._calls.append((method, args))
            if not self._wake.is_set():
                self._wake.set()

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self._put("log_hyperparams", dict(params))

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._put("log_metrics", {k: float(v) for k, v in metrics.items()}, step)

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        """Checkpoints are uploaded at the end when ``log_model`` asks (:meth:`finalize`)."""

    def finalize(self, status: str) -> None:
        """Lightning's end of a fit or a validation: the run goes on (its last validation), so the
        status is kept for :meth:`close`."""
        self._status = status

    @rank_zero_only
    def close(self) -> None:
        """The end of the run: what is queued is sent, bounded by :attr:`flush_seconds`."""
        if self._closing.is_set():
            return
        self._put("finalize", getattr(self, "_status", "success"))
        self._closing.set()
        self._wake.set()
        if not self._done.wait(self.flush_seconds):
            say(f"warning: {self.label}: still sending after {self.flush_seconds:.0f} s; the run ends without it")
            self.failed = self.failed or "timed out"


def merged(calls: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """``calls`` (``(method, args)``, in order) with each run of ``log_metrics`` calls made one
    ``log_steps`` call of their ``(metrics, step)`` rows, the calls for the same step one row (a
    later value of a key wins, as it would in the tracker): what the tracker's thread gathered is
    one MLflow request and one W&B history row a step."""
    out: list[tuple[str, tuple]] = []
    for method, args in calls:
        if method != "log_metrics":
            out.append((method, args))
            continue
        if not out or out[-1][0] != "log_steps":
            out.append(("log_steps", ([],)))
        rows = out[-1][1][0]
        metrics, step = args
        if rows and rows[-1][1] == step:
            rows[-1] = ({**rows[-1][0], **metrics}, step)
        else:
            rows.append((metrics, step))
    return out


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)
    return out


def flat_params(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved recipe (its spec inline) as one flat mapping of dotted keys a tracker can filter on."""
    return _flat(config)


def _mlflow_logger(options, out: Path, title: str, resuming: bool, parent: dict | None):
    _client("mlflow", "mlflow")
    from lightning.pytorch.loggers import MLFlowLogger  # local: it imports mlflow, an optional extra

    stored = stored_ids(out).get("mlflow", {}) if resuming else {}
    tags = dict(options.tags)
    if parent and parent.get("run_id"):
        tags["mlflow.parentRunId"] = parent["run_id"]
    uri = options.tracking_uri
    if uri is None:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(out) / "mlruns").resolve().as_uri()
    for name, value in MLFLOW_RETRIES.items():
        os.environ.setdefault(name, value)

    def make():
        logger = MLFlowLogger(
            experiment_name=options.experiment or title,
            run_name=options.name or title,
            tracking_uri=uri,
            tags=tags or None,
            run_id=stored.get("run_id"),
            synchronous=True,
        )
        store_id(out, "mlflow", {"run_id": logger.run_id, "experiment_id": logger.experiment_id, "tracking_uri": uri})
        return _Uploading(logger, out, options.log_model, "mlflow")

    return Background("mlflow", make)


def _wandb_logger(options, out: Path, title: str, resuming: bool, parent: dict | None):
    _client("wandb", "wandb")
    from lightning.pytorch.loggers import WandbLogger  # local: it imports wandb, an optional extra

    stored = stored_ids(out).get("wandb", {}) if resuming else {}
    run_id = stored.get("id") or uuid.uuid4().hex[:8]
    store_id(out, "wandb", {"id": run_id})
    parent_id = (parent or {}).get("id")

    def make():
        logger = WandbLogger(
            name=options.name or title,
            project=options.project or title,
            entity=options.entity,
            tags=[f"{k}:{v}" if v else k for k, v in options.tags.items()] or None,
            offline=options.offline,
            save_dir=str(out),
            id=run_id,
            resume="allow",
            group=parent_id,
            notes=f"cooldown of W&B run {parent_id}" if parent_id else None,
        )
        logger.experiment  # noqa: B018 - starts the run here, on this thread
        return _Uploading(logger, out, options.log_model, "wandb")

    return Background("wandb", make)


class _Uploading:
    """A tracker's logger that takes several steps' metrics at once (:meth:`log_steps`) and
    uploads the run's checkpoints at its finalize when ``log_model``."""

    def __init__(self, logger, out: Path, log_model: bool, kind: str):
        self.logger, self.out, self.log_model, self.kind = logger, Path(out), log_model, kind

    def __getattr__(self, name):
        return getattr(self.logger, name)

    def log_hyperparams(self, params: dict) -> None:
        """MLflow keeps a run's params as first logged: a resumed run adds the new ones (a setting
        it changed shows as a ``resumed.<key>`` tag)."""
        if self.kind == "mlflow":
            client, run_id = self.logger.experiment, self.logger.run_id
            logged = client.get_run(run_id).data.params
            for key, value in params.items():
                if key in logged and logged[key] != str(value):
                    client.set_tag(run_id, f"resumed.{key}", str(value)[:5000])
            params = {k: v for k, v in params.items() if k not in logged}
        self.logger.log_hyperparams(params)

    def log_steps(self, rows: list[tuple[dict[str, float], int | None]]) -> None:
        """The ``(metrics, step)`` rows: for MLflow one ``log_batch`` request (it takes any steps;
        its client splits what is over its limit), for W&B a history row each."""
        if self.kind != "mlflow":
            for metrics, step in rows:
                self.logger.log_metrics(metrics, step)
            return
        from mlflow.entities import Metric  # local: mlflow is an optional extra

        now = int(time.time() * 1000)
        batch = [
            Metric(key=_MLFLOW_DROPPED.sub("", key), value=value, timestamp=now, step=step or 0)
            for metrics, step in rows
            for key, value in metrics.items()
        ]
        self.logger.experiment.log_batch(run_id=self.logger.run_id, metrics=batch, synchronous=True)

    def finalize(self, status: str) -> None:
        if self.log_model:
            for ckpt in ("last.ckpt", "best.ckpt"):
                path = self.out / "checkpoints" / ckpt
                if not path.is_file():
                    continue
                if self.kind == "mlflow":
                    self.logger.experiment.log_artifact(self.logger.run_id, str(path), "checkpoints")
                else:
                    self.logger.experiment.save(str(path), base_path=str(self.out), policy="end")
        self.logger.finalize(status)
        if self.kind == "wandb":  # Lightning leaves the W&B run open: the next run in this process would reuse it
            self.logger.experiment.finish(exit_code=0 if status == "success" else 1)


#: the characters MLflow refuses in a metric's name, which Lightning's ``MLFlowLogger.log_metrics``
#: drops from it too
_MLFLOW_DROPPED = re.compile(r"[^a-zA-Z0-9_/. -]+")

#: the trackers by their ``trainer.loggers`` key
MAKERS = {"mlflow": _mlflow_logger, "wandb": _wandb_logger}


def tracker_loggers(loggers, out: Path, title: str, resuming: bool, parent_folder: Path | None) -> list:
    """The trackers ``loggers`` (the recipe's ``trainer.loggers``) names, on global rank 0 only.
    ``resuming``: reopen the tracked runs stored in ``out``; ``parent_folder``: the run folder a
    branch started from, whose tracked runs are its parents."""
    if rank_zero_only.rank != 0:
        return []
    parents = stored_ids(parent_folder) if parent_folder is not None else {}
    made = []
    for key, make in MAKERS.items():
        options = getattr(loggers, key)
        if options is not None:
            made.append(make(options, Path(out), title, resuming, parents.get(key)))
    return made
