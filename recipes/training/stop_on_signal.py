"""The callback that stops a run at a step boundary after a signal, every rank at the same step.

What each signal means, and when, is :mod:`yamlformer.recipes.training.signals` (torch-free,
installed as ``builder train`` starts); this is the part that needs the Trainer. Lightning's own
handlers are set aside while training runs: its SIGTERM handler stops at a point that can differ
between ranks, and its SLURM ``SIGUSR1`` handler saves from inside the handler, mid-step, to
``hpc_ckpt_N.ckpt`` files a resume does not read (it is never installed: Lightning adds it only
where no handler of ``SIGUSR1`` is in place). Here every rank stops at the same step: with
several processes the ranks agree through one all-reduce of the signal per step, read a step
later on CUDA devices (a pinned copy and an event), so it costs no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from yamlformer.builder.checkpoints import CheckpointWriteError
from yamlformer.recipes.training.signals import SignalStop, Stopped


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
        # a warning kept from the run's start: the stop's line says why it came after one step
        at = f"at step {step}" + (" (received before training started)" if self.stop.early else "")
        try:
            saved = self.save(trainer)
        except CheckpointWriteError as exc:
            raise Stopped(signum, f"{at}; {exc}") from None
        self.stop.done = Stopped(signum, f"{at}; saved {saved}; run the same command to resume")
        together = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        if together and self.then is not None:
            dist.barrier()  # every rank's shards are written before rank 0 requeues (the requeue ends the job)
        after = self.then(signum) if self.then is not None and trainer.is_global_zero else None
        if after is not None:
            self.stop.done = Stopped(signum, f"{at}; saved {saved}; {after}")
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
