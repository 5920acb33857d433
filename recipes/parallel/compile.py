"""``torch.compile`` (``trainer.compile``), the third step of :func:`yamlformer.recipes.parallel.parallelize`,
with its cache kept in the run folder and its time measured apart from the steps.

* ``model`` compiles the module's loss computation — the whole model, the loss and, through
  AOTAutograd, their backward — into one graph per input shape (:func:`compiled_losses`). The
  fastest step; validation, sampling and decoding run the model as built (no recompiles for
  ``eval()`` or a KV cache).
* ``layers`` compiles each Transformer layer in place (regional compilation, as torchtitan does
  after activation checkpointing and before FSDP2's ``fully_shard``): identical layers share one
  compiled graph, so the cold compile is a fraction of ``model``'s, and it composes with FSDP2 and
  activation checkpointing.
* ``true`` is ``layers`` under FSDP or activation checkpointing and ``model`` otherwise.

Validation, decoding and everything after training run eagerly (:func:`eager`): compiling them
would cost more than it saves on a few batches, and a KV cache recompiles at every length.

Inductor's caches (FX graph, AOTAutograd, Triton) go to ``<output_dir>/compile-cache``, so a
resumed run finds its kernels compiled (:func:`compiling`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch._dynamo.callback import callback_handler
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir


def compile_mode(trainer) -> str | None:
    """``model``, ``layers`` or None for a recipe's ``trainer`` section (see the module doc)."""
    mode = trainer.compile
    if mode is False:
        return None
    if mode is True:
        return "layers" if trainer.strategy == "fsdp" or trainer.activation_checkpointing else "model"
    return mode


def compile_layers(layers: list[torch.nn.Module]) -> None:
    """Compile each layer in place (``Module.compile``: names and state dicts stay as they are)."""
    for layer in layers:
        layer.compile()


def compiled_losses(losses: Callable, trainer, dynamic: bool = False) -> Callable:
    """A module's training-loss computation compiled whole when ``trainer.compile`` means
    ``model`` (``dynamic``: for batches that vary in shape from the start), else ``losses`` itself."""
    if compile_mode(trainer) != "model":
        return losses
    return torch.compile(losses, dynamic=True if dynamic else None)


def eager():
    """A context in which compiled code runs as written (validation, decoding, evaluation after
    training): no recompiles for ``eval()``, KV caches or new shapes."""
    return torch.compiler.set_stance("force_eager")


class CompileClock:
    """Wall seconds spent compiling (Dynamo tracing, AOTAutograd, Inductor, lazily compiled
    backward graphs) while it is installed, and how many compilations there were."""

    def __init__(self):
        self.seconds = 0.0
        self.count = 0
        self._started: float | None = None

    def _start(self, args) -> None:
        self._started = time.perf_counter()

    def _end(self, args) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.count += 1
            self._started = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[CompileClock]:

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        try:
            yield self
        finally:
            callback_handler.remove_start_callback(self._start)
            callback_handler.remove_end_callback(self._end)


@contextlib.contextmanager
def compiling(out: Path) -> Iterator[CompileClock]:
    """Inductor's caches under ``out/compile-cache`` (in-memory caches cleared on the way in and
    out, so what compiles here is looked up there) and a :class:`CompileClock` for what runs inside."""

    clock = CompileClock()
    with temporary_cache_dir(str(Path(out).resolve() / "compile-cache")), clock.installed():
        yield clock
