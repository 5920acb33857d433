"""What a run shows: throughput and MFU, the progress bar, the loss curve, the time limit and the
line that says why it stopped (its checkpoints are ``yamlformer.recipes.training.checkpointing``)."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n

from yamlformer.builder.analysis.mfu import mfu, peak_flops
from yamlformer.recipes.parallel import data_parallel_size
from yamlformer.recipes.say import publish
from yamlformer.recipes.training.precision import estimate_dtype


class Throughput(L.Callback):
    """Tokens/s, achieved TFLOP/s and MFU from the analytic FLOPs, on the progress bar and logs
    (the median of the last :attr:`SMOOTHING` intervals).

    Timed over intervals of ``every_n_steps`` optimizer steps, with one device sync at each
    interval's end (none in between); an interval that runs into validation is not counted."""

    #: intervals the shown tokens/s is the median of
    SMOOTHING = 5

    def __init__(self, device_tokens_per_step: int, flops_per_token: int, precision: str, every_n_steps: int):
        self.device_tokens_per_step, self.flops_per_token = device_tokens_per_step, flops_per_token
        self.precision, self.every_n_steps = precision, every_n_steps
        self.tokens_per_step = device_tokens_per_step
        self.peak_flops: float | None = None  # all devices together
        self.tokens_per_s: float | None = None  # the latest shown (smoothed) measurement
        self.intervals: list[tuple[int, float, float]] = []  # (steps, seconds, tokens), validation left out
        self._start: float | None = None
        self._steps = 0

    def _restart(self):
        self._start, self._steps = time.perf_counter(), 0

    def on_train_start(self, trainer, pl_module):

        self.tokens_per_step = self.device_tokens_per_step * data_parallel_size(trainer)
        device = pl_module.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        dtype = estimate_dtype(self.precision)
        if dtype == "fp32" and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            dtype = "tf32"  # the peak fp32 matmuls reach here
        peak = peak_flops(name, dtype)
        self.peak_flops = peak * trainer.world_size if peak else None
        self._restart()

    def on_validation_end(self, trainer, pl_module):
        self._restart()  # validation time is not training throughput; the interval it cut is dropped

    def interval_tokens(self) -> float:
        """Tokens (all devices) of the interval now ending."""
        return self._steps * self.tokens_per_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self._steps += 1
        if trainer.global_step % self.every_n_steps or self._start is None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        elapsed = time.perf_counter() - self._start
        tokens = self.interval_tokens()
        self.intervals.append((self._steps, elapsed, tokens))
        # shown and logged: the median of the last SMOOTHING intervals, so one slow interval (a
        # checkpoint written, a busy machine) does not swing the number by 5x
        recent = sorted(t / s for _, s, t in self.intervals[-self.SMOOTHING :])
        self.tokens_per_s = recent[len(recent) // 2]
        achieved = self.tokens_per_s * self.flops_per_token
        metrics = {"tok/s": self.tokens_per_s, "TFLOP/s": achieved / 1e12}
        if self.peak_flops:
            metrics["MFU"] = mfu(self.tokens_per_s, self.flops_per_token, self.peak_flops)
        publish(trainer, metrics)
        self._restart()

    def median_tokens_per_s(self) -> float | None:
        """Tokens/s of the median interval (robust to a noisy machine and to compilation, which
        falls in the first interval)."""
        if not self.intervals:
            return None
        rates = sorted(tokens / seconds for _, seconds, tokens in self.intervals)
        return rates[len(rates) // 2]


class CountedThroughput(Throughput):
    """:class:`Throughput` for batches of varying size: the real tokens of each micro-batch
    (``tokens_of``) are summed on the device and read at the interval's end, times the world size."""

    def __init__(self, tokens_of, flops_per_token: int, precision: str, every_n_steps: int):
        super().__init__(0, flops_per_token, precision, every_n_steps)
        self.tokens_of = tokens_of
        self._tokens = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):

        self._tokens = self._tokens + self.tokens_of(batch)  # a device tensor for some tasks: no read here
        self._world = data_parallel_size(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def interval_tokens(self) -> float:
        tokens, self._tokens = float(self._tokens), 0
        return tokens * self._world

    def on_validation_end(self, trainer, pl_module):
        super().on_validation_end(trainer, pl_module)
        self._tokens = 0


class StepProgressBar(TQDMProgressBar):
    """The training bar counts the run's micro-batches to ``max_steps`` (not an epoch's: a run is
    steps, and Lightning's "Epoch N" counts passes over the data loader, so a resumed run said
    "Epoch 1"), from where the run stands: a resumed run's bar starts at its checkpoint's step and
    its rate counts this invocation's steps only (it counted the restored ones as done in the
    first interval). It shows readable numbers: Lightning's metrics and what :func:`publish`
    shows (host numbers, refreshed at log steps)."""

    _FORMATS = {"tok/s": "{:,.0f}", "TFLOP/s": "{:.3g}", "MFU": "{:.1%}", "loss": "{:.4f}", "val_loss": "{:.4f}"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shown: dict[str, float] = {}

    @property
    def total_train_batches(self):
        trainer = self.trainer
        return trainer.max_steps * trainer.accumulate_grad_batches

    def on_train_start(self, trainer, pl_module):
        # a run resumed inside an epoch gets no on_train_epoch_start, which sets the total: set it here
        super().on_train_start(trainer, pl_module)
        bar, done = self.train_progress_bar, trainer.global_step * trainer.accumulate_grad_batches
        bar.reset(self.total_train_batches)
        bar.initial = bar.n = done  # tqdm's rate counts from `initial`: this invocation's batches
        bar.set_description(f"train (resumed at step {trainer.global_step:,})" if done else "train")
        bar.refresh()

    def on_train_epoch_start(self, trainer, *_):
        """A new pass over the data goes on counting the run's batches (Lightning's restarts at 0)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        accumulate = trainer.accumulate_grad_batches
        n = trainer.global_step * accumulate + (batch_idx + 1) % accumulate  # the run's, not the epoch's
        if self._should_update(n, self.train_progress_bar.total):
            _update_n(self.train_progress_bar, n)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer, pl_module):
        metrics = {**super().get_metrics(trainer, pl_module), **self.shown}
        metrics.pop("v_num", None)
        for name, fmt in self._FORMATS.items():
            if isinstance(metrics.get(name), (int, float)):
                metrics[name] = fmt.format(metrics[name])
        return metrics


def plot_losses(history: dict, path: Path, title: str) -> Path | None:
    """The training and validation loss curves as a PNG (``None`` without matplotlib)."""
    try:
        # optional extra: matplotlib (pip install 'yamlformer[plot]')
        import matplotlib

        matplotlib.use("Agg")
        # optional extra: matplotlib (pip install 'yamlformer[plot]')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if history["train"]:
        steps, losses = zip(*history["train"])
        ax.plot(steps, losses, lw=0.8, alpha=0.8, label="train")
    if history["val"]:
        steps, losses = [v[0] for v in history["val"]], [v[1] for v in history["val"]]
        ax.plot(steps, losses, "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class InvocationTimer(Timer):
    """``trainer.max_time``, counted per invocation: a resumed run gets the whole limit again.
    (Lightning's own ``max_time`` restores the time already spent from the checkpoint, so a run its
    limit stopped trained 0 steps on every later resume.) Checked after each optimizer step; silent,
    since the run's last line names the cause (:func:`stop_line`)."""

    def __init__(self, duration):
        super().__init__(duration=duration, interval="step", verbose=False)

    def load_state_dict(self, state_dict: dict) -> None:
        """The checkpoint's time already spent is not carried: this invocation's clock starts at 0."""


def stop_line(settings, first_step: int, step: int) -> str:
    """One line naming why ``fit`` returned (a signal and a NaN raise instead) and how to go on.
    ``settings``: the recipe's trainer section; ``first_step``: where this invocation started."""
    if step >= settings.max_steps:
        if step == first_step:
            return (
                f"nothing to train: the checkpoint is at step {step:,}, trainer.max_steps {settings.max_steps:,}; "
                "raise trainer.max_steps (--set trainer.max_steps=N) to go on, or --fresh to start over"
            )
        return f"stopped: trainer.max_steps {settings.max_steps:,} reached"
    if settings.max_time is not None:
        return (
            f"stopped: trainer.max_time {settings.max_time} (per invocation) reached at step {step:,} of "
            f"{settings.max_steps:,}; run the same command again to go on from step {step:,}, or add "
            "--set trainer.max_time=null to train to max_steps without a time limit"
        )
    return f"stopped at step {step:,} of {settings.max_steps:,}"
