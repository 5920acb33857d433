"""Where a study lives: an Optuna study in a real database (``optuna.storages.RDBStorage``; SQLite
beside the study by default, a server URL for several machines). Each trial's variant, costs and
results are its user attributes, its validation losses its intermediate values, so a report, a
fit or a resumed sweep read the database alone.

Opening refuses, in one line each: a file that is no database or another program's, a database
locked past the timeout, the default database holding another study, and a study of this name
made from another definition (other recipe, axes or budget).
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import warnings
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy.engine
import sqlalchemy.event
import sqlalchemy.exc
from optuna.trial import TrialState

from yamlformer.builder.spec.source import Problem, SpecError
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.studies.schema import StudyFile

#: seconds a database locked by another process is waited for (``BUILDER_STUDY_DB_TIMEOUT``)
LOCK_TIMEOUT = 30.0
#: a running trial proves it is alive this often (s); a trial silent for GRACE is failed and rerun
HEARTBEAT, GRACE = 15, 60


class StudyError(RecipeError):
    """A study database that cannot be used as asked (one line)."""


def _sqlite_file(url: str) -> Path | None:
    return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None


def _check_sqlite(path: Path, timeout: float) -> None:
    """A file that exists must be SQLite and hold Optuna's tables (or none yet)."""
    if not path.exists():
        return
    if path.is_dir():
        raise StudyError(f"{path}: is a folder, not a study database")
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        raise StudyError(_db_message(path, exc)) from None
    if tables and "studies" not in tables:
        raise StudyError(f"{path}: a database of another program (no Optuna study tables); give storage: another file")


def _db_message(where: Any, exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).splitlines()[0]
    if "locked" in text:
        return (
            f"{where}: the study database is locked by another process (waited {_timeout():g} s); "
            "wait for it, or give storage: a database server URL for several workers"
        )
    if "not a database" in text or "malformed" in text:
        return f"{where}: not a study database ({text})"
    return f"{where}: cannot open the study database: {text}"


def _timeout() -> float:
    try:
        return float(os.environ.get("BUILDER_STUDY_DB_TIMEOUT", LOCK_TIMEOUT))
    except ValueError:
        return LOCK_TIMEOUT


def check_storage(loaded: StudyFile) -> None:
    """A storage URL that cannot be opened here for want of a database driver (or of a dialect
    SQLAlchemy knows), said at once, located at ``storage:`` and without the URL's password, not
    after every variant is checked. SQLite needs nothing."""
    url = loaded.storage
    if url.startswith("sqlite:"):
        return

    scheme = url.partition(":")[0][:40]
    try:
        sqlalchemy.engine.make_url(url).get_dialect().import_dbapi()
    except ImportError as exc:
        missing = getattr(exc, "name", None) or "its driver"
        message = (
            f"a {scheme}:// database needs the Python driver {missing!r}, which is not installed here; install "
            "it (SQLAlchemy's page for the dialect names the package), or leave storage out for SQLite"
        )
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ValueError):
        message = f"not a database URL SQLAlchemy knows ({scheme}://...); e.g. postgresql://user@host/db"
    else:
        return
    raise SpecError([Problem.at(loaded.mark("storage"), "storage", message)])


def storage_of(url: str):
    """The RDB storage at ``url`` (heartbeats on, SQLite waiting for locks); one line when it cannot open."""

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # heartbeats of asked trials, recorded by the sweep itself (Optuna's own are for optimize())
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    timeout = _timeout()
    path = _sqlite_file(url)
    kwargs: dict[str, Any] = {}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_sqlite(path, timeout)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": timeout}}
    try:
        storage = optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT, grace_period=GRACE, **kwargs)
    except ImportError as exc:  # a server's driver (check_storage says so before any work)
        raise StudyError(f"{path or url.partition(':')[0]}: no database driver here ({exc.name or exc})") from None
    except (sqlalchemy.exc.SQLAlchemyError, RuntimeError, ValueError) as exc:
        raise StudyError(_db_message(path or url, exc)) from None
    if path is not None and os.access(path, os.W_OK):
        _serialize(storage.engine)
    return storage


def _serialize(engine) -> None:
    """Make each of Optuna's transactions on a SQLite file take the write lock as it begins
    (SQLAlchemy's recipe for pysqlite, with ``BEGIN IMMEDIATE``). pysqlite begins a transaction
    only at the first write and SQLite has no ``SELECT ... FOR UPDATE``, so two workers asking at
    once both read a waiting trial as waiting and both took it (a sweep's array tasks ran one
    variant twice, 4 asks in 10, and the second ``tell`` found it finished); a server database
    locks the row itself. Connections made before (Optuna's schema check) are dropped."""

    @sqlalchemy.event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection, record) -> None:
        dbapi_connection.isolation_level = None

    @sqlalchemy.event.listens_for(engine, "begin")
    def _begin_locked(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()


def open_study(loaded: StudyFile, create: bool, sampler=None, pruner=None):
    """``(optuna study, created)``: the study of ``loaded`` in its storage, made when ``create``
    and it is not there (its definition recorded), else checked to be the same study."""

    name, where = loaded.name, _sqlite_file(loaded.storage) or loaded.storage
    if not create and isinstance(where, Path) and not where.exists():  # reading: never make an empty database
        raise StudyError(f"{where}: no study database (run `builder sweep {loaded.path}` first)")
    storage = storage_of(loaded.storage)
    try:
        names = optuna.get_all_study_names(storage)
        if name not in names:
            if not create:
                held = f"; it holds {', '.join(map(repr, names))}" if names else "; it holds none"
                raise StudyError(f"{where}: no study {name!r} (run `builder sweep {loaded.path}` first){held}")
            if names and loaded.default_storage:
                raise StudyError(
                    f"{where}: the database of another study ({', '.join(map(repr, names))}), not {name!r}; "
                    "move it away, or set output_dir or storage"
                )
            try:
                study = optuna.create_study(
                    storage=storage, study_name=name, direction="minimize", sampler=sampler, pruner=pruner
                )
            except optuna.exceptions.DuplicatedStudyError:  # another machine made it just now
                pass
            else:
                study.set_user_attr("definition", loaded.definition())
                study.set_user_attr("fingerprint", loaded.fingerprint())
                return study, True
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
        _check_same(loaded, study, where)
        return study, False
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise StudyError(_db_message(where, exc)) from None


def _check_same(loaded: StudyFile, study, where) -> None:
    saved = study.user_attrs.get("fingerprint")
    if saved is None:
        raise StudyError(f"{where}: study {loaded.name!r} was not made by `builder sweep`; give the study another name")
    if saved == loaded.fingerprint():
        return
    before, now = study.user_attrs.get("definition") or {}, loaded.definition()
    changed = [
        key for key in now if json.dumps(before.get(key), sort_keys=True) != json.dumps(now[key], sort_keys=True)
    ]
    raise StudyError(
        f"{where}: study {loaded.name!r} was made from another definition ({', '.join(changed) or 'its fields'} "
        f"differ from {loaded.path}); a study's variants are fixed: give this one another name"
    )


# -- trials ---------------------------------------------------------------------------------------


def encode(value: Any) -> Any:
    """A value as an Optuna categorical choice (numbers, strings, booleans, None; else its JSON)."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value)


def worker() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def is_alive_here(who: str | None) -> bool:
    """Whether the worker ``host:pid`` runs on this machine now (elsewhere: assumed alive)."""
    host, _, pid = (who or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(study) -> int:
    """Make a killed study whole again: a running trial of a dead worker on this machine, or one
    whose heartbeat stopped, is failed as interrupted; each interrupted trial whose variant has
    not finished since is queued again (its run folder's checkpoint resumes it). Returns how many."""

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not is_alive_here(trial.user_attrs.get("worker")):
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
    optuna.storages.fail_stale_trials(study)
    trials = study.get_trials(deepcopy=False)
    settled = {
        t.user_attrs.get("variant")
        for t in trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
        or "error" in t.user_attrs
    }
    queued = 0
    for trial in trials:
        variant = trial.user_attrs.get("variant")
        if trial.state == TrialState.FAIL and "error" not in trial.user_attrs and variant and variant not in settled:
            study.enqueue_trial(trial.params, user_attrs={"variant": variant, "resumes": trial.number})
            settled.add(variant)
            queued += 1
    return queued


def retry_failed(study) -> int:
    """Queue again every variant whose last trial failed with an error (``--retry-failed``)."""

    latest = {}
    for trial in study.get_trials(deepcopy=False):
        latest[trial.user_attrs.get("variant")] = trial
    queued = 0
    for variant, trial in latest.items():
        if (
            variant
            and trial.state == TrialState.FAIL
            and "error" in trial.user_attrs
            and not trial.user_attrs.get("invalid")
        ):
            study.enqueue_trial(trial.params, user_attrs={"variant": variant, "retries": trial.number})
            queued += 1
    return queued


def latest_trials(study) -> list:
    """One trial per variant, its latest (a resumed trial replaces the interrupted one); trials
    of no variant (an ask that found the queue empty) left out. In trial order."""
    latest = {}
    for trial in study.get_trials(deepcopy=False):
        variant = trial.user_attrs.get("variant")
        if variant:
            latest[variant] = trial
    return sorted(latest.values(), key=lambda t: t.number)


def status(trial) -> str:
    """complete, pruned, failed, invalid, interrupted, running or waiting."""

    attrs = trial.user_attrs
    if trial.state == TrialState.FAIL:
        return "invalid" if attrs.get("invalid") else ("failed" if "error" in attrs else "interrupted")
    return {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.RUNNING: "running"}.get(
        trial.state, "waiting"
    )


def heartbeat(study, trial) -> None:
    """Prove a running trial alive, as ``study.optimize`` does in a thread (Optuna has no public
    call for an asked trial)."""
    study._storage.record_heartbeat(trial._trial_id)
