"""The run folder (``trainer.output_dir``): checked writable before any work, held by one
``builder train`` at a time, and resumed only by the recipe that made it.

* :func:`claim` makes the folder (and ``data.cache_dir``) and writes into them before any
  tokenizer is trained or model built, so a read-only, full or misnamed folder fails in one line
  at once; then takes an exclusive lock on ``run.lock`` in it (``fcntl.flock``, released by the
  kernel when the process dies, however it dies). A second run on the folder stops at once,
  naming the holder's pid and host; a lock left by a process that is gone is taken over with a
  message. The holder refreshes the file's time every minute, so a record from another machine
  on a filesystem whose locks do not reach across machines is trusted while it is fresh.
  Only the process that owns the folder (global rank 0: :func:`owns_run_folder`) locks it; the
  other ranks of a multi-process run never touch the lock.
* :func:`recipe_differences` compares the recipe a checkpoint was trained with to the one
  running now: the fields that shape the run (model, data, tokenizer, optimizer, schedule, loss,
  seed, precision, batch) must match; :data:`MAY_CHANGE` lists the ones that may change when a
  run is resumed (how long, how often to validate, log and checkpoint, where it runs, samples).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from yamlformer.builder.checkpoints import write_reason
from yamlformer.builder.spec.schema import spec_model
from yamlformer.recipes.data.registry import DATASETS
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.tasks import recipe_class

LOCK_FILE = "run.lock"
#: seconds between refreshes of the lock file's time by its holder
HEARTBEAT_S = 60.0
#: a record from another machine older than this is a run that is gone
STALE_S = 5 * HEARTBEAT_S

#: the environment variables that carry a process's rank (torchrun, SLURM, Lightning's launcher,
#: MPI): a process owns the run folder when every one of them that is set is 0
RANK_VARIABLES = (
    "RANK",
    "GROUP_RANK",
    "NODE_RANK",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "JSM_NAMESPACE_RANK",
)

#: recipe fields (dotted prefixes) that may differ when a run is resumed: they decide how long it
#: runs, how often it validates, logs and checkpoints, where it runs and what it prints at the
#: end, not what it learns. Every other field must match. ``model.spec`` and ``model.overrides``
#: are compared as the resolved spec they make, so moving the recipe or writing an override in
#: the spec file instead is no difference.
MAY_CHANGE = (
    "name",
    "harness",
    "model.spec",
    "model.overrides",
    "data.cache_dir",
    "data.root",
    "trainer.max_steps",
    "trainer.max_time",
    "trainer.val_check_interval",
    "trainer.limit_val_batches",
    "trainer.checkpoint_every_n_steps",
    "trainer.keep_every_n_steps",
    "trainer.log_every_n_steps",
    "trainer.output_dir",
    "trainer.accelerator",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.strategy",
    "trainer.tensor_parallel",
    "trainer.context_parallel",
    "trainer.expert_parallel",
    "trainer.data_parallel",
    "trainer.pipeline_parallel",
    "trainer.pipeline_schedule",
    "trainer.microbatches",
    "trainer.compile",
    "trainer.activation_checkpointing",
    "sample",
    "eval",
)


def owns_run_folder(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0 of its run (or runs alone), read from the launcher's
    environment before any process group exists."""
    environ = os.environ if environ is None else environ
    for name in RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value and value != "0":
            return False
    return True


# -- writable folders ------------------------------------------------------------------------------


def os_problem(exc: OSError) -> str:
    """One line for an OS error: the file and the reason."""
    where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
    return f"{where}{write_reason(exc)}"


def check_writable(folder: Path, field: str) -> Path:
    """Make ``folder`` and write a small file into it; a :class:`RecipeError` naming ``field``
    and the path when it is a file, cannot be made, or cannot be written."""
    folder = Path(folder)
    for parent in (folder, *folder.parents):
        if parent.exists() and not parent.is_dir():
            what = "is a file" if parent == folder else f"is under {parent}, which is a file"
            raise RecipeError(f"{field} {folder} {what}, not a folder; set {field} to a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"builder\n")
                f.flush()
                os.fsync(f.fileno())
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
    except OSError as exc:
        raise RecipeError(f"{field} {folder} is not writable: {write_reason(exc)}") from None
    return folder


# -- the lock ----------------------------------------------------------------------------------------


def _holder_record() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _read_record(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    if not raw.strip():
        return None
    try:
        record = json.loads(raw.decode("utf-8", errors="replace"))
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(record: Mapping[str, Any]) -> str:
    return f"pid {record.get('pid', '?')} on host {record.get('host', '?')}" + (
        f", started {record['started']}" if record.get("started") else ""
    )


class RunLock:
    """An exclusive lock on ``folder/run.lock`` for this process (see the module docstring)."""

    def __init__(self, folder: Path, field: str = "trainer.output_dir"):
        self.folder, self.field = Path(folder), field
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.took_over: dict[str, Any] | None = None  # the record of a run that was gone

    def _busy(self, record: Mapping[str, Any] | None) -> RecipeError:
        holder = _describe(record) if record else "another process"
        return RecipeError(
            f"{self.field} {self.folder} is in use by another `builder train` ({holder}); "
            f"wait for it to finish or stop it, or set {self.field} to another folder"
        )

    def acquire(self) -> RunLock:
        try:
            # local: POSIX only
            import fcntl
        except ImportError:  # not POSIX: the record alone decides
            fcntl = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RecipeError(f"{self.field} {self.folder}: cannot open {self.path}: {write_reason(exc)}") from None
        try:
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._busy(_read_record(fd)) from None
            except OSError as exc:  # a filesystem without flock: the record alone decides
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
            record = _read_record(fd)
            if record is not None and not self._gone(record, fd):
                raise self._busy(record)
            self.took_over = record
            mine = json.dumps(_holder_record()).encode() + b"\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, mine, 0)
            os.fsync(fd)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                reason = write_reason(exc)
                raise RecipeError(f"{self.field} {self.folder}: cannot write {self.path}: {reason}") from None
            raise
        self._fd = fd
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="builder-run-lock", daemon=True)
        self._heartbeat.start()
        return self

    def _gone(self, record: Mapping[str, Any], fd: int) -> bool:
        """A record left behind: its process is gone (this host), or it has not been refreshed
        for :data:`STALE_S` (another host, where this host cannot see the process)."""
        if not record:
            return True  # unreadable: not a live holder's record
        if record.get("host") == socket.gethostname():
            return record.get("pid") == os.getpid() or not _pid_alive(record.get("pid"))
        age = time.time() - os.fstat(fd).st_mtime
        return age > STALE_S

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError, TypeError):
                os.utime(self._fd)

    def release(self) -> None:
        """Clear the record (a clean end) and unlock."""
        if self._fd is None:
            return
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the descriptor releases the flock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# -- debris and --fresh ------------------------------------------------------------------------------


def remove_debris(folder: Path) -> list[Path]:
    """Remove the temp files and folders of saves that never finished (``.NAME.tmp-ID``) under
    ``folder``: the lock is held, so no save is running. Returns what was removed."""
    removed = []
    if not folder.is_dir():
        return removed
    for path in folder.rglob(".*.tmp-*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        removed.append(path)
    return removed


def set_aside(checkpoints: Path) -> Path | None:
    """``--fresh`` on a folder with checkpoints: move them to ``checkpoints.before-fresh-TIME``
    (nothing is deleted; the new run's checkpoints never mix with the old)."""
    if not checkpoints.is_dir() or not any(checkpoints.iterdir()):
        return None
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = checkpoints.with_name(f"{checkpoints.name}.before-fresh-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = checkpoints.with_name(f"{checkpoints.name}.before-fresh-{stamp}-{n}")
    os.replace(checkpoints, target)
    return target


@contextlib.contextmanager
def claim(out: Path, cache_dir: Path | None = None, fresh: bool = False, say=print) -> Iterator[Path]:
    """The run folder ``out``, writable and locked for this run while the block runs (see the
    module docstring); ``cache_dir`` checked writable too. With ``fresh``, earlier checkpoints are
    set aside first. On the ranks that do not own the folder this only yields ``out``."""
    out = Path(out)
    if not owns_run_folder():
        yield out
        return
    check_writable(out, "trainer.output_dir")
    lock = RunLock(out).acquire()
    try:
        if cache_dir is not None:
            check_writable(Path(cache_dir), "data.cache_dir")
        if lock.took_over:
            say(f"taking over {lock.path}: the run that held it ({_describe(lock.took_over)}) is no longer running")
        remove_debris(out)
        if fresh:
            moved = set_aside(out / "checkpoints")
            if moved is not None:
                say(f"--fresh: the earlier checkpoints are kept in {moved}")
        yield out
    finally:
        lock.release()


# -- what a resumed run may change ---------------------------------------------------------------------


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; lists and other values are leaves."""
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def _may_change(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in MAY_CHANGE)


def _show(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def recipe_dump(located, working_dir: bool = False) -> dict[str, Any]:
    """The recipe of ``located`` (a :class:`yamlformer.recipes.recipe.located.LocatedRecipe`, or a
    ``Run``) as ``model_dump(mode="json")`` with its paths absolute: the fields whose schema says
    ``relative_to: recipe`` (data files, a tokenizer file, init_from), and with ``working_dir`` also
    those relative to the working directory (cache and output folders). Dataset names stay names.
    What a checkpoint keeps (so a resume started from another file or folder compares equal)."""
    recipe = located.recipe
    dumped = recipe.model_dump(mode="json")
    _absolute_paths(recipe, dumped, Path(located.file).resolve().parent, Path.cwd() if working_dir else None)
    return dumped


def _absolute_paths(model: BaseModel, dumped: dict, recipe_dir: Path, cwd: Path | None) -> None:

    def absolute(value, base: Path):
        if isinstance(value, list):
            return [absolute(v, base) for v in value]
        if isinstance(value, dict):
            return {k: absolute(v, base) for k, v in value.items()}
        if value in DATASETS:  # a dataset's name (in data.sources) stays a name
            return value
        return str((base / Path(value).expanduser()).resolve())

    for name, field in type(model).model_fields.items():
        if name not in dumped:  # left out of a compact dump (a data source's unset fields)
            continue
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            _absolute_paths(value, dumped[name], recipe_dir, cwd)
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        base = {"recipe": recipe_dir, "cwd": cwd}.get(extra.get("relative_to"))
        if base is None or dumped[name] is None:
            continue
        if isinstance(value, list):  # items that are sections (data.sources entries) mark their own paths
            dumped[name] = [
                _absolute_paths(item, entry, recipe_dir, cwd) or entry
                if isinstance(entry, dict)
                else absolute(entry, base)
                for item, entry in zip(value, dumped[name])
            ]
        else:
            dumped[name] = absolute(dumped[name], base)


def _normalised(dump: Mapping[str, Any], schema, **validate) -> dict[str, Any]:
    """A recipe's or a spec's dump re-validated by the current ``schema``, so a field added since
    the checkpoint was written compares as its default (the dump as it is when it no longer validates)."""
    try:
        return schema.model_validate(dict(dump), **validate).model_dump(mode="json")
    except Exception:
        return dict(dump)


def _normalised_recipe(recipe: Mapping[str, Any]) -> dict[str, Any]:

    return _normalised(recipe, recipe_class(recipe.get("task", "lm")), strict=False)


#: fields that may change on resume as long as the global batch they make with the layout stays the same
GLOBAL_BATCH = ("data.batch_size", "trainer.accumulate_grad_batches")


def global_batch(recipe: Mapping[str, Any]) -> int | None:
    """Sequences per optimizer step of a flattened recipe: ``batch_size x accumulate x`` the
    data-parallel ranks (devices x nodes, over the tensor-, context- and pipeline-parallel degrees under fsdp);
    None when the devices are not a count."""
    devices, batch = recipe.get("trainer.devices"), recipe.get("data.batch_size")
    if isinstance(devices, list):  # device indices (trainer.devices normalises "[0, 1]" so)
        devices = len(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1 or not isinstance(batch, int):
        return None
    fsdp = recipe.get("trainer.strategy") == "fsdp"
    model = 1  # ranks that read the same batch: tensor-parallel peers, context-parallel peers, stages
    for field in ("trainer.tensor_parallel", "trainer.context_parallel", "trainer.pipeline_parallel"):
        model *= (recipe.get(field, 1) or 1) if fsdp else 1
    ranks = devices * recipe.get("trainer.num_nodes", 1) // max(1, model)
    return batch * recipe.get("trainer.accumulate_grad_batches", 1) * ranks


def _schedule_kept(saved: Mapping[str, Any], current: Mapping[str, Any], step: int | None) -> bool:
    """Whether the two recipes' learning rates agreed at every step a checkpoint at ``step`` took
    (``yamlformer.recipes.optim.schedule.same_through``): then its ``schedule`` may change on resume (a
    warmup-stable-decay run lengthened, a cooldown branched from its stable phase)."""
    # local: the optimizer package loads torch; a run's folder is checked torch-free (the dry run)
    from yamlformer.recipes.optim.schedule import same_through

    if not isinstance(step, int) or saved.get("task", "lm") != current.get("task", "lm"):
        return False
    try:
        cls = recipe_class(current.get("task", "lm"))
        a, b = (cls.model_validate(dict(dump), strict=False) for dump in (saved, current))
    except Exception:
        return False
    return same_through(a, b, step)


def recipe_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], step: int | None = None
) -> tuple[list[str], list[str]]:
    """``(refused, allowed)``: one line per differing field of two recipe dumps, split by
    :data:`MAY_CHANGE` (and :data:`GLOBAL_BATCH` while the global batch is unchanged: a run moved
    from 4 processes of batch 1 to 2 of batch 2 trains on the same windows; and ``schedule`` where
    both gave the same learning rate at every step a checkpoint at ``step`` took)."""
    a, b = flatten(_normalised_recipe(saved)), flatten(_normalised_recipe(current))
    same_batch = global_batch(a) is not None and global_batch(a) == global_batch(b)
    schedule_kept = any(k.startswith("schedule.") and a.get(k) != b.get(k) for k in set(a) | set(b)) and (
        _schedule_kept(saved, current, step)
    )
    refused, allowed = [], []
    missing = object()
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, missing), b.get(key, missing)
        if old == new:
            continue
        line = (
            f"{key}: {'(not set)' if old is missing else _show(old)} in the checkpoint, "
            f"{'(not set)' if new is missing else _show(new)} now"
        )
        if key in GLOBAL_BATCH and same_batch:
            line += f" (the global batch stays {global_batch(b)})"
        kept = schedule_kept and key.startswith("schedule.")
        if kept:
            line += " (the same learning rate at every step taken)"
        (allowed if _may_change(key) or kept or (key in GLOBAL_BATCH and same_batch) else refused).append(line)
    return refused, allowed


def _normalised_spec(spec: Mapping[str, Any]) -> dict[str, Any]:

    return _normalised(spec, spec_model())


def spec_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per differing field of two resolved specs (``model.spec.decoder.n_layers: ...``);
    a field one of them predates counts as its default."""
    a, b = flatten(_normalised_spec(saved), "model.spec"), flatten(_normalised_spec(current), "model.spec")
    missing = object()
    lines = []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, missing), b.get(key, missing)
        if old != new:
            lines.append(
                f"{key}: {'(not set)' if old is missing else _show(old)} in the checkpoint, "
                f"{'(not set)' if new is missing else _show(new)} now"
            )
    return lines


def resume_differences(
    saved: Mapping[str, Any], meta: Mapping[str, Any], step: int | None = None
) -> tuple[list[str], list[str]]:
    """What differs between a checkpoint's ``builder`` metadata and this run's: ``(refused,
    allowed)`` lines. The recipe field by field (``step``: the checkpoint's, for a schedule
    :func:`recipe_differences` may let change), the resolved spec field by field, the
    tokenizer, the task and the corpus."""
    refused, allowed = recipe_differences(saved.get("recipe") or {}, meta.get("recipe") or {}, step)
    refused += spec_differences(saved.get("spec") or {}, meta.get("spec") or {})
    if saved.get("tokenizer") != meta.get("tokenizer"):
        refused.append("tokenizer: a different vocabulary (trained on other text or with other settings)")
    for key, what in (("task", "task"), ("corpus", "data: the corpus text")):
        if key in saved and key in meta and saved[key] != meta[key]:
            refused.append(f"{what}: {_show(saved[key])} in the checkpoint, {_show(meta[key])} now")
    return refused, allowed
