"""The LightningModule around a built model: loss, the recipe's optimizer and schedule, resumable state."""

from __future__ import annotations

import copy
import functools
import math
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from yamlformer.blocks.heads import IGNORE
from yamlformer.recipes.optim import build_optimizer, check_optimizer
from yamlformer.recipes.optim.schedule import lr_multiplier
from yamlformer.recipes.parallel import data_parallel_rank
from yamlformer.recipes.parallel.compile import compile_mode, compiled_losses
from yamlformer.recipes.parallel.strategy import clip_grad_norm
from yamlformer.recipes.recipe.sections import Recipe
from yamlformer.recipes.say import publish


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stops and keeps its last good checkpoint.

    Losses are read every ``log_every_n_steps`` steps (and before every checkpoint), so the step
    is known to lie in ``first .. step``."""

    def __init__(self, first: int, step: int, value: float):
        self.first, self.step, self.value = first, step, value
        where = f"at step {step}" if first >= step else f"between steps {first} and {step}"
        super().__init__(
            f"the training loss became {value} {where}; stopping. The last good checkpoint is kept: "
            "lower optimizer.lr, raise schedule.warmup_steps, set trainer.gradient_clip_val or use "
            "precision 32 / bf16-mixed, then resume or start fresh"
        )


#: where Lightning's fit loop counts optimizer steps (``trainer.global_step``): automatic
#: optimization (one process, FSDP, TP) and manual (a pipeline's schedule steps the optimizer)
AUTOMATIC_STEPS = "epoch_loop.automatic_optimization.optim_progress"
MANUAL_STEPS = "epoch_loop.manual_optimization.optim_step_progress"


def carry_optimizer_steps(checkpoint: dict, automatic: bool) -> None:
    """A checkpoint's optimizer steps moved to the counter this run reads: Lightning counts them
    in the automatic loop or in the manual one, and a run resumed in the other mode (a pipelined
    run resumed without ``trainer.pipeline_parallel``, or the other way) would restart at step 0.
    The steps the saved run counted replace the other counter's (which it left at zero)."""

    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    if AUTOMATIC_STEPS not in loop or MANUAL_STEPS not in loop:
        return
    auto, manual = loop[AUTOMATIC_STEPS]["optimizer"], loop[MANUAL_STEPS]
    if automatic and manual["total"]["completed"] > auto["step"]["total"]["completed"]:
        auto["step"] = copy.deepcopy(manual)
        auto["zero_grad"] = {
            phase: {**manual[phase], "started": manual[phase]["completed"]} for phase in ("total", "current")
        }
    elif not automatic and auto["step"]["total"]["completed"] > manual["total"]["completed"]:
        loop[MANUAL_STEPS] = copy.deepcopy(auto["step"])


def selects_scored(model: nn.Module, trainer) -> bool:
    """Whether a task that scores few positions has the head project only those: when the model's
    head computes positions alone (``scores_positions``), the loss is not compiled whole (the
    selection's size depends on the data) and no tensor or context parallelism splits the
    sequence the head reads. The loss is the same either way (``tests/test_scored_positions.py``)."""
    return (
        bool(getattr(model, "scores_positions", lambda: False)())
        and compile_mode(trainer) != "model"
        and trainer.tensor_parallel == 1
        and trainer.context_parallel == 1
    )


def micro_batch_seed(seed: int, rank: int, micro_batch: int) -> int:
    """The seed of the global generator for micro-batch ``micro_batch`` (counted over the whole
    run) on data-parallel rank ``rank``: dropout's masks are a pure function of where the run is,
    so a resumed run draws what an unbroken one does (on any number of ranks: no generator state
    to save and gather), validation and data loading draw nothing that training sees, and
    data-parallel ranks draw independent masks while tensor-parallel peers (one data rank) share
    them. Python's hash of a tuple of ints is the same in every process."""
    return hash((seed, rank, micro_batch)) & ((1 << 63) - 1)


def seed_generators(device: torch.device, seed: int) -> None:
    """Seed the generators a training step on ``device`` draws from: the CPU's and, on a GPU, that
    device's. (``torch.manual_seed`` seeds every device kind torch knows, and for each one not yet
    initialised it records a stack trace to report with a failure later: milliseconds a step.)"""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        torch.cuda.default_generators[index].manual_seed(seed)


class LMModule(L.LightningModule):
    """Next-token prediction with a model from ``build_model``.

    ``meta`` (the validated spec, the recipe and the tokenizer state) rides in every checkpoint
    under ``"builder"``, so evaluating and decoding need nothing else.
    """

    #: whether batches vary in shape (token-budget buckets): compiled for dynamic shapes from the start
    variable_shapes = False
    #: whether the loss scores a minority of positions (``IGNORE`` elsewhere: instruction data's
    #: prompts, MLM's unmasked tokens), so the head projects only those (:meth:`logits_and_targets`)
    scores_only_targets = False

    def __init__(self, model: nn.Module, recipe: Recipe, meta: dict):
        super().__init__()
        self.model, self.recipe, self.meta = model, recipe, meta
        self.spec = getattr(model, "spec", None)  # the optimizer's groups read it (a pipeline stage has none)
        check_optimizer(recipe.optimizer, model, meta.get("recipe_file"), self.spec)  # located, before any step
        # the whole run, across resumes: train (step, mean loss since the entry before); val (step,
        # loss, training wall seconds)
        self.history: dict[str, list] = {"train": [], "val": []}
        self.elapsed = 0.0  # wall seconds of training before this process took over
        self.first_step = 0  # the step this invocation starts from (a resumed run: its checkpoint's)
        self._data_rank = 0  # this rank among those reading different data (on_train_start)
        self._started: float | None = None
        # a balancing loss or a head's multi-token-prediction losses join the cross-entropy
        self.adds_aux_losses = model.has_aux_losses()
        self.label_smoothing, self.moe_aux_coef = recipe.loss.label_smoothing, recipe.loss.moe_aux_coef
        # training losses summed on the device and read at log intervals only: no host sync per step
        self._pending: torch.Tensor | None = None  # the sum since the last read
        self._pending_steps = 0  # micro-batches in it
        self._pending_from = 0  # the step the first of them trained
        self._carried: float | None = None  # a sum not read when the checkpoint resumed from was written
        self._train_losses = compiled_losses(self._losses, recipe.trainer, dynamic=self.variable_shapes)
        self._select_scored = self.scores_only_targets and selects_scored(model, recipe.trainer)
        # trainer.pipeline_parallel: the strategy cuts the model into stages (configure_model) and
        # training_step drives their schedule, so it steps the optimizer itself (yamlformer.recipes.parallel.pipeline)
        self.pipeline = None
        self.automatic_optimization = recipe.trainer.pipeline_parallel == 1

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def configure_model(self):
        """Under ``strategy: fsdp`` the strategy shards the model here, after the processes and
        the device mesh exist (``yamlformer.recipes.parallel.strategy.ShardedStrategy.parallelize``); under
        ``trainer.pipeline_parallel`` the model becomes this rank's part of it, and its stages a
        :class:`yamlformer.recipes.parallel.pipeline.Pipeline` (``ShardedStrategy.pipeline``)."""
        if not self.automatic_optimization:
            if self.pipeline is None:
                self.model, self.pipeline = self.trainer.strategy.pipeline(
                    self.model, self._micro_batch_loss, balance_weight=self.moe_aux_coef
                )
            return
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:
            self.model = parallelize(self.model)

    def _micro_batch_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The pipeline's loss of one micro-batch, computed by its last stage (the cross-entropy of :meth:`_losses`)."""
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            targets.reshape(-1),
            ignore_index=IGNORE,
            label_smoothing=self.label_smoothing,
        )

    def _pipelined_step(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimizer step through the pipeline's schedule (manual optimization): every
        micro-batch's forward and backward, the gradients clipped over every stage, the step
        and the learning-rate schedule. Returns the batch's mean loss (on every rank)."""

        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        optimizer.zero_grad(set_to_none=True)
        loss = self.pipeline.train_step(input_ids, targets)
        clip = self.recipe.trainer.gradient_clip_val
        if clip is not None:
            clip_grad_norm(self.model.parameters(), clip, self.pipeline.group, leave_out=self.pipeline.duplicates)
        optimizer.step()
        scheduler.step()
        self.model.after_optimizer_step()
        return loss

    def logits_and_targets(self, input_ids, targets, document_ids=None):
        """The model's logits for a batch and the ids they predict (``IGNORE``: no loss there);
        ``document_ids``: each input's document in a packed row (``data.packing: doc_masked``).
        A task's module overrides this; the loss, logging and optimizer stay as they are.
        Under context parallelism (the model's ``context_shard``, ``yamlformer.recipes.parallel.context``)
        the inputs and targets are this rank's share of each row, placed by their token indices."""
        shard = getattr(self.model, "context_shard", None)
        if shard is not None:
            input_ids, targets = shard.split(input_ids, targets)
            token_index = shard.token_index(input_ids.shape[1] * shard.degree, input_ids.device)
            return self.model(input_ids, token_index=token_index), targets
        options = {} if document_ids is None else {"document_ids": document_ids}
        if self._select_scored:  # the scored positions' logits only: (n, vocab), (n,)
            scored = targets != IGNORE
            return self.model(input_ids, scored=scored, **options), targets[scored]
        return self.model(input_ids, **options), targets  # (batch, seq, vocab), (batch, seq)

    def _losses(self, *batch):
        logits, targets = self.logits_and_targets(*batch)
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            targets.reshape(-1),
            ignore_index=IGNORE,
            label_smoothing=self.label_smoothing,
        )
        if not self.adds_aux_losses:
            return ce, ce
        # the model's auxiliary losses (yamlformer.blocks.stacks): the balancing loss weighed by the recipe's
        # coefficient, the head's by their own spec fields
        loss = ce
        for aux in self.model.aux_losses(balance_weight=self.moe_aux_coef).values():
            loss = loss + aux
        return loss, ce

    def training_step(self, batch, batch_idx):
        if self.pipeline is not None:
            loss = ce = self._pipelined_step(*batch)
        else:
            loss, ce = self._train_losses(*batch)
        ce = ce.detach().float()
        if self._pending is None and self._carried is not None:  # a resumed run's interval, from its checkpoint
            self._pending, self._carried = ce + self._carried, None
        elif self._pending is None:
            self._pending, self._pending_from = ce.clone(), self.global_step
        else:
            self._pending += ce
        self._pending_steps += 1
        return loss if self.automatic_optimization else None

    def _log_step(self) -> bool:
        return self.global_step % self.trainer.log_every_n_steps == 0

    def on_train_batch_end(self, outputs, batch, batch_idx):
        stepped = (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0
        if stepped and self._log_step():
            if not self.flush_losses() and self.history["train"] and self.history["train"][-1][0] == self.global_step:
                # read already by the checkpoint written at this step: logged now
                publish(self.trainer, {"loss": self.history["train"][-1][1]})

    def _pending_mean_sum(self) -> float:
        """The pending sum averaged over the ranks (every rank calls this at the same step), read
        once; raises if it is not finite."""
        total = self.trainer.strategy.reduce(self._pending, reduce_op="mean")
        value = float(total)
        if not math.isfinite(value):
            raise NonFiniteLossError(self._pending_from + 1, self.global_step, value)
        return value

    def flush_losses(self, log: bool = True) -> bool:
        """Read the training losses summed since the last read (one host sync), stop the run if
        one was not finite, add their mean to the history (and to the logs with ``log``).
        Returns whether there was anything to read."""
        if self._pending is None:
            return False
        value = self._pending_mean_sum() / self._pending_steps
        self._pending, self._pending_steps = None, 0
        self.history["train"].append((self.global_step, value))
        if log:
            publish(self.trainer, {"loss": value})
        return True

    def validation_step(self, batch, batch_idx):
        ce = self.pipeline.evaluate(*batch) if self.pipeline is not None else self._losses(*batch)[1]
        self.log("val_loss", ce, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True)
        return ce

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        after_step = getattr(self.model, "after_optimizer_step", None)
        if after_step is not None:
            after_step()  # blocks' state kept outside the gradients (yamlformer.blocks.stacks)

    def on_train_start(self):

        self._started = time.perf_counter() - self.elapsed
        self._data_rank = data_parallel_rank(self.trainer)  # for micro_batch_seed, once per run

    def on_validation_start(self):
        torch.compiler.set_stance(
            "force_eager"
        )  # validation runs the layers as built (yamlformer.recipes.parallel.compile)

    def on_validation_end(self):
        torch.compiler.set_stance("default")

    def wall_seconds(self) -> float:
        """Wall seconds of training so far, across resumes (validation included)."""
        return time.perf_counter() - self._started if self._started is not None else self.elapsed

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking and "val_loss" in self.trainer.callback_metrics:
            loss = float(self.trainer.callback_metrics["val_loss"])
            self.history["val"].append((self.global_step, loss, self.wall_seconds()))

    def configure_optimizers(self):
        opt = self.recipe.optimizer  # any registered kind: its groups, state and class are its own
        optimizer = build_optimizer(opt, self.model, self.spec)
        multiplier = functools.partial(
            lr_multiplier, schedule=self.recipe.schedule, lr=opt.peak_lr, max_steps=self.recipe.trainer.max_steps
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._pending is not None and self.trainer.training and self._log_step():
            self.flush_losses(log=False)  # the interval ends here: its entry goes into this checkpoint
        pending = None
        if self._pending is not None:  # raises before a checkpoint of non-finite weights is written
            total = self._pending_mean_sum()
            self._pending = torch.full_like(self._pending, total)
            pending = {"sum": total, "steps": self._pending_steps, "from": self._pending_from}
        checkpoint["builder"] = dict(self.meta, history=self.history, elapsed=self.wall_seconds(), pending_loss=pending)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        carry_optimizer_steps(checkpoint, self.automatic_optimization)
        saved = checkpoint.get("builder", {})
        self.first_step = int(checkpoint.get("global_step", 0))
        self.history = saved.get("history", {"train": [], "val": []})
        self.elapsed = saved.get("elapsed", 0.0)
        pending = saved.get("pending_loss")
        self._pending, self._carried, self._pending_steps = None, None, 0
        if pending:
            self._carried, self._pending_steps, self._pending_from = pending["sum"], pending["steps"], pending["from"]

    def on_train_batch_start(self, batch, batch_idx):
        accumulate = self.trainer.accumulate_grad_batches
        micro_batch = self.global_step * accumulate + batch_idx % accumulate
        seed_generators(self.device, micro_batch_seed(self.recipe.trainer.seed, self._data_rank, micro_batch))
