"""Stopping a run on a signal without losing it. Torch-free: ``builder train`` installs these
handlers as it starts, before torch and Lightning load.

``SIGTERM`` is how schedulers (SLURM, Kubernetes, torchrun's agent) stop a job, ``SIGINT`` is
Ctrl+C, and ``SIGUSR1`` is what SLURM sends ahead of a time limit or pre-emption when asked
(``#SBATCH --signal=USR1@120``). During training, the first of them lets the current optimizer
step finish, saves ``last.ckpt`` at that step boundary (a checkpoint that resumes exactly), and
stops the run with :class:`Stopped`: one line, exit status 128 + the signal's number (143 for
SIGTERM, 130 for SIGINT, 138 for SIGUSR1). A second ``SIGTERM`` or ``SIGINT`` while the step
finishes stops at once, keeping the last checkpoint written.

The handlers hold from the first thing ``builder train`` does (``recipes/commands/train.py``, its
``run``), so no signal that comes while the run starts (torch and Lightning loading, the recipe
resolved, data downloaded and tokenized, the model built, the ranks meeting) kills the process by
its default action; only the interpreter's own start and the command line's parsing come before
them (half a second). What a signal means before training:

* ``SIGTERM`` and ``SIGINT`` stop at once: there is nothing to save (one line, 143 or 130).
* ``SIGUSR1`` is a warning, never a stop: it is kept, the run starts as it would have, and at its
  first optimizer-step boundary it saves ``last.ckpt``, global rank 0 requeues the SLURM job
  (:mod:`yamlformer.recipes.training.requeue`) and every rank exits 138, exactly as for a warning
  mid-run. So a warning that SLURM sends as an attempt starts (a requeued attempt whose start-up
  outlasted the time limit less the warning's lead, or a pre-emption) neither ends the job nor
  loses it, and each attempt adds at least one step: a job warned at every start still moves on
  and never requeues in place. The lead (``USR1@N``) must cover start-up, one step and the save.

A second ``SIGUSR1`` changes nothing; one after training ended is let pass (every checkpoint is
written; what the run does after it goes on, and the time limit's ``SIGTERM`` still stops it).
``SIGTERM`` or ``SIGINT`` after training ended stops at once.

Once the checkpoint is written no rank exits before the others have it and, under SLURM, before
rank 0 has requeued the job after its ``SIGUSR1``: the ranks meet at a barrier, and a signal then
(``srun --kill-on-bad-exit`` stopping the ranks, the requeue ending the job) is let pass once,
since the run is already stopping with its checkpoint.

The callback that acts at the step boundary is :class:`yamlformer.recipes.training.stop_on_signal.StopOnSignal`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

#: the signal SLURM sends ahead of a time limit in this project's batch files (``--signal=USR1@N``)
WARNING = getattr(signal, "SIGUSR1", None)
SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, WARNING) if s is not None)


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
    """The signals of one run: recorded while a step finishes (``deferring``) and a warning
    (:data:`WARNING`) at any time before training ends, to be acted on at the next step
    boundary; else raised as :class:`Stopped` at once (and passed on to the processes this one
    launched)."""

    def __init__(self):
        self.received: int | None = None
        self.early = False  # what was received came before training started
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
        if signum == WARNING:  # a warning never stops at once: it asks for a save at the next step boundary
            if self.received is None and not self.trained:
                self.received, self.early = signum, not self.deferring
            return
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
        """Its handlers in place while the block runs, the previous ones given back after it; a
        block inside one that installed them already leaves them in place."""
        if self._previous:
            yield self
            return
        self.install()
        try:
            yield self
        finally:
            self.restore()
