"""Stopping a run on a signal without losing it.

``SIGTERM`` is how schedulers (SLURM, Kubernetes, torchrun's agent) stop a job, ``SIGINT`` is
Ctrl+C, and ``SIGUSR1`` is what SLURM sends ahead of a time limit or pre-emption when asked
(``#SBATCH --signal=USR1@120``). During training, the first of them lets the current optimizer
step finish, saves ``last.ckpt`` at that step boundary (a checkpoint that resumes exactly), and
stops the run with :class:`Stopped`: one line, exit status 128 + the signal's number (143 for
SIGTERM, 130 for SIGINT, 138 for SIGUSR1). Before training starts there is nothing to save and
the run stops at once; after it ends every checkpoint is already written. A second signal while
the step finishes stops at once, keeping the last checkpoint written.

Once the checkpoint is written no rank exits before the others have it and, under SLURM, before
rank 0 has requeued the job after its ``SIGUSR1`` (:mod:`yamlformer.recipes.training.requeue`):
the ranks meet at a barrier, and a signal then (``srun --kill-on-bad-exit`` stopping the ranks, the
requeue ending the job) is let pass once, since the run is already stopping with its checkpoint.

Lightning's own handlers are set aside while training runs: its SIGTERM handler stops at a point
that can differ between ranks, and its SLURM ``SIGUSR1`` handler saves from inside the handler,
mid-step, to ``hpc_ckpt_N.ckpt`` files a resume does not read. Here every rank stops at the same
step: with several processes the ranks agree through one all-reduce of the signal per step,
read a step later on CUDA devices (a pinned copy and an event), so it costs no host sync.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from yamlformer.builder.checkpoints import CheckpointWriteError

SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Stopped(BaseException):
    """A run stopped by a signal: ``str()`` says when and what was saved; ``exit_code`` is 128 +
    the signal's number."""

    def __init__(self, signum: int, what: str):
        self.signum, self.exit_code = int(signum), 128 + int(signum)
        super().__init__(f"stopped by {signal_name(signum)} {what}")


class SignalStop:
    """The signals of one run: recorded while a step finishes (``deferring``), else raised as
    :class:`Stopped` at once (and passed on to the processes this one launched)."""

    def __init__(self):
        self.received: int | None = None
        self.deferring = False
        self.trained = False  # training has ended: every checkpoint is written
        self.forward: Callable[[int], None] | None = None  # passes a signal on to launched ranks
        self.done: Stopped | None = None  # the stop of a run whose checkpoint is written
        self._let_pass = 1  # signals let pass once done (the requeue and the exit race them)
        self._previous: dict[int, object] = {}

    def handle(self, signum, frame) -> None:
        if self.done is not None:
            if self._let_pass:
                self._let_pass -= 1
                return
            raise self.done
        if self.deferring and self.received is None:
            self.received = signum  # acted on at the end of this optimizer step
            return
        self.received = self.received or signum
        if self.forward is not None:
            with contextlib.suppress(Exception):
                self.forward(signum)
        if self.deferring:
            raise Stopped(
                signum, "again before the step ended: stopping without saving; the last checkpoint written is kept"
            )
        if self.trained:
            raise Stopped(signum, "after training ended; its checkpoints were already saved")
        raise Stopped(signum, "before training started; there was nothing to save")

    def install(self) -> None:
        """Handle :data:`SIGNALS` in this process (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            previous = signal.signal(signum, self.handle)
            self._previous.setdefault(signum, previous)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, previous)
        self._previous = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[SignalStop]:
        self.install()
        try:
            yield self
        finally:
            self.restore()


class StopOnSignal(L.Callback):
    """Saves ``last.ckpt`` (``save(trainer) -> path``) and raises :class:`Stopped` at the first
    optimizer-step boundary after a signal, on every rank at the same step. ``then(signum)``, on
    global rank 0 once the checkpoint is written and before any rank exits, says what becomes of
    the run (a SLURM requeue) or None. Goes after the callbacks that save at the end of training."""

    def __init__(
        self, stop: SignalStop, save: Callable[[L.Trainer], Path], then: Callable[[int], str | None] | None = None
    ):
        self.stop, self.save, self.then = stop, save, then
        self._inflight = None  # (pinned host copy, CUDA event) of the last step's agreement
        self._buffers = None
        self._steps = 0

    def on_train_start(self, trainer, pl_module):
        self.stop.install()  # over Lightning's handlers (it restores ours when fit tears down)
        self.stop.deferring = True
        launcher = getattr(trainer.strategy, "launcher", None)
        if trainer.is_global_zero and callable(getattr(launcher, "kill", None)):
            self.stop.forward = launcher.kill  # Lightning's launcher: the ranks it started

    def _agreed(self, trainer, now: bool = False) -> int:
        """The signal any rank received (0: none); with several CUDA processes, the agreement of
        the previous step unless ``now`` (the flag is filled on the device by a kernel, reduced,
        and copied to pinned memory behind an event, so the host never waits on the queue)."""
        local = self.stop.received or 0
        if trainer.world_size == 1:
            return local

        if not (dist.is_available() and dist.is_initialized()):
            return local
        flag = torch.full((1,), local, dtype=torch.int32, device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.device.type != "cuda" or now:
            self._inflight = None
            return int(flag.item())
        if self._buffers is None:  # two pinned slots: one being written, the other read
            self._buffers = [torch.empty(1, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        host = self._buffers[self._steps % 2]
        self._steps += 1
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self._inflight = self._inflight, (host, event)
        if previous is None:
            return 0
        previous[1].synchronize()
        return int(previous[0].item())

    def _stop_here(self, trainer, signum: int) -> None:

        self.stop.received = signum
        step = trainer.global_step
        try:
            saved = self.save(trainer)
        except CheckpointWriteError as exc:
            raise Stopped(signum, f"at step {step}; {exc}") from None
        self.stop.done = Stopped(signum, f"at step {step}; saved {saved}; run the same command to resume")
        together = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        if together and self.then is not None:
            dist.barrier()  # every rank's shards are written before rank 0 requeues (the requeue ends the job)
        after = self.then(signum) if self.then is not None and trainer.is_global_zero else None
        if after is not None:
            self.stop.done = Stopped(signum, f"at step {step}; saved {saved}; {after}")
        if together:
            dist.barrier()  # no rank exits before the checkpoint is written and the job requeued
        raise self.stop.done

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        signum = self._agreed(trainer)
        if signum:
            self._stop_here(trainer, signum)

    def on_train_end(self, trainer, pl_module):
        signum = self._agreed(trainer, now=True)
        self.stop.deferring = False
        self.stop.trained = True
        if signum:
            self._stop_here(trainer, signum)  # the checkpoints of the end are written: this one is too
