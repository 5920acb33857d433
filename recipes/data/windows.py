"""Batches of windows for the LM and MLM tasks, and the data module that resumes them.

Micro-batch ``j`` of optimizer step ``s`` on data-parallel rank ``r`` takes the ``batch_size``
windows from global index ``first + (j x ranks + r) x batch_size``, where ``first`` is the windows
every earlier step took (:mod:`yamlformer.recipes.data.mixture` says which window an index is). The data
position is that one integer, saved in checkpoints: a resumed run takes exactly the windows an
unbroken one would, on any number of ranks, and one global batch is the same windows however it
is split (N devices with batch B, one device with batch N x B, or N accumulated micro-batches).

With ``data.packing: doc_masked`` a batch is ``(inputs, targets, document_ids)``: each input's
document within its row (the model masks attention across them and restarts positions), and no
target where the next token starts another document. Training batches are made in a worker
process ahead of the step (``data.num_workers``).
"""

from __future__ import annotations

import signal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from yamlformer.blocks.heads import IGNORE
from yamlformer.recipes.data.mixture import NO_VALIDATION, TRAIN, VALIDATION, Source, Windows, shares
from yamlformer.recipes.errors import RecipeError


def to_batch(ids: np.ndarray, documents: np.ndarray | None, packing: str) -> tuple[torch.Tensor, ...]:
    """``(inputs, targets)`` of windows ``ids`` ``(batch, seq_len + 1)``; with ``doc_masked`` and
    document ends, ``(inputs, targets, document_ids)``."""
    block = torch.from_numpy(ids)
    inputs, targets = block[:, :-1], block[:, 1:]
    if packing != "doc_masked" or documents is None:
        return inputs, targets
    documents = torch.from_numpy(documents)
    targets = targets.masked_fill(documents[:, 1:] != documents[:, :-1], IGNORE)
    return inputs, targets, documents[:, :-1].contiguous()


def worker_ignores_signals(_worker_id: int) -> None:
    """A batch-making worker leaves Ctrl+C, SIGTERM and SLURM's SIGUSR1 to the training process
    (a terminal and a scheduler signal the whole process group): that process saves and stops
    and takes its workers down; a worker that died of the signal would end the run as an error."""

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


class Mixture:
    """The training and validation windows of a corpus's sources, ready to be taken by index."""

    def __init__(self, sources: list[Source], seed: int, vocab_size: int, packing: str = "concat"):
        self.sources, self.seed, self.vocab_size, self.packing = sources, seed, vocab_size, packing
        weights = shares(sources)
        self.train = Windows([s.train for s in sources], weights, seed, TRAIN)
        held = [i for i, s in enumerate(sources) if s.validation is not None and s.validation.n_windows > 0]
        if not held:
            raise RecipeError(NO_VALIDATION)
        self.held_out = held
        self.validation = Windows([sources[i].validation for i in held], weights[held], seed, VALIDATION)

    def batch(self, windows: Windows, first: int, count: int) -> tuple[torch.Tensor, ...]:
        ids, documents, labels = windows.take(first, count)
        top = int(ids.max())
        if top >= self.vocab_size:
            names = (
                [s.name for s in self.sources]
                if windows is self.train
                else [self.sources[i].name for i in self.held_out]
            )
            bad = names[int(labels[int(np.argmax(ids.max(axis=1)))])]
            raise RecipeError(
                f"{bad}: token id {top} is outside the tokenizer's vocabulary of {self.vocab_size:,} "
                "(the source was tokenized with another tokenizer)"
            )
        return to_batch(ids, documents, self.packing)


class TrainWindows(IterableDataset):
    """Endless micro-batches from global window ``position`` on; this rank's slice of each step."""

    def __init__(
        self, mixture: Mixture, batch_size: int, rank: int, world_size: int, position: int, accumulate: int = 1
    ):
        self.mixture, self.batch_size, self.rank, self.world_size = mixture, batch_size, rank, world_size
        self.position, self.accumulate = position, accumulate

    def __iter__(self):
        per_step = self.batch_size * self.world_size * self.accumulate
        index = 0  # micro-batches taken
        while True:
            step, micro = divmod(index, self.accumulate)
            first = self.position + step * per_step + (micro * self.world_size + self.rank) * self.batch_size
            yield self.mixture.batch(self.mixture.train, first, self.batch_size)
            index += 1


class ValWindows(IterableDataset):
    """The same ``n_batches`` micro-batches of held-out windows at every validation."""

    def __init__(self, mixture: Mixture, batch_size: int, n_batches: int, rank: int, world_size: int):
        self.mixture, self.batch_size, self.n_batches = mixture, batch_size, n_batches
        self.rank, self.world_size = rank, world_size

    def __len__(self):
        return self.n_batches

    def __iter__(self):
        for index in range(self.n_batches):
            first = (index * self.world_size + self.rank) * self.batch_size
            yield self.mixture.batch(self.mixture.validation, first, self.batch_size)


def loader(data, trainer, workers: int = 0, worker_init_fn=None) -> DataLoader:
    """A loader of ready micro-batches (``data`` yields whole batches): ``workers`` processes
    prefetching four each, and pinned host memory when the run trains on a CUDA GPU, so that
    Lightning's non-blocking copy to the device does not stage through pageable memory."""
    pin = trainer is not None and trainer.strategy.root_device.type == "cuda"
    return DataLoader(
        data,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        persistent_workers=False,
        worker_init_fn=worker_init_fn,
        pin_memory=pin,
    )


class PositionedDataModule(L.LightningDataModule):
    """A data module whose whole state is its position: the micro-batches consumed, restored
    from checkpoints (``accumulate`` micro-batches per optimizer step)."""

    def __init__(self, seed: int, accumulate: int):
        super().__init__()
        self.seed, self.accumulate = seed, accumulate
        self.position = 0

    def _rank(self) -> tuple[int, int]:
        """``(rank, ranks)`` among the ranks that read different data (tensor-parallel peers
        read the same)."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("rank", trainer.global_rank)), int(kwargs.get("num_replicas", trainer.world_size))

    def state_dict(self) -> dict:
        if self.trainer is not None:
            self.position = self.trainer.global_step * self.accumulate
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class LMDataModule(L.LightningDataModule):
    """Training and validation windows of a :class:`Mixture`. Its state is the global windows
    taken by the end of a step, so a run resumes on any number of ranks."""

    def __init__(
        self, mixture: Mixture, batch_size: int, seed: int, val_batches: int, accumulate: int, num_workers: int = 1
    ):
        super().__init__()
        self.mixture, self.batch_size, self.seed = mixture, batch_size, seed
        self.val_batches, self.accumulate, self.num_workers = val_batches, accumulate, num_workers
        self._resumed = (0, 0)  # (windows taken, at step) of the checkpoint this run started from

    _rank = PositionedDataModule._rank

    def windows_taken(self, step: int) -> int:
        """Global windows every step before ``step`` took, this run's steps at this run's ranks."""
        windows, at = self._resumed
        return windows + (step - at) * self.batch_size * self._rank()[1] * self.accumulate

    def micro_batches_taken(self) -> int:
        """This rank's micro-batches so far at this run's ranks (the MLM masking's counter)."""
        step = self.trainer.global_step if self.trainer is not None else self._resumed[1]
        return self.windows_taken(step) // (self.batch_size * self._rank()[1])

    def state_dict(self) -> dict:
        step = self.trainer.global_step if self.trainer is not None else self._resumed[1]
        return {"windows": self.windows_taken(step), "step": step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if "windows" in state:
            self._resumed = (int(state["windows"]), int(state["step"]))
        else:  # a checkpoint from before windows were counted: its micro-batches at this run's ranks
            micro = int(state["position"])
            self._resumed = (micro * self.batch_size * self._rank()[1], micro // self.accumulate)

    def train_dataloader(self):
        rank, world = self._rank()
        step = self.trainer.global_step if self.trainer is not None else self._resumed[1]
        data = TrainWindows(self.mixture, self.batch_size, rank, world, self.windows_taken(step), self.accumulate)
        workers = self.num_workers
        return loader(data, self.trainer, workers, worker_ignores_signals if workers else None)

    def val_dataloader(self):
        rank, world = self._rank()
        return loader(ValWindows(self.mixture, self.batch_size, self.val_batches, rank, world), self.trainer)
