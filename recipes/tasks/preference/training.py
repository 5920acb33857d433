"""``task: preference``'s training side: the pairs, tokenizer and rows of a run (:func:`prepare`),
the reference model (:class:`Reference`), the LightningModule (:class:`PreferenceModule`), the
held-out pairs scored before the first step and after the last (:class:`HeldOut`); ``builder eval``
on its checkpoints (``builder generate`` is SFT's)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import math
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from yamlformer.blocks.linear import adapter_parameters, adapters_disabled, linear_layers
from yamlformer.builder.assemble import build_model
from yamlformer.recipes.data.chat import ChatFormat
from yamlformer.recipes.data.files import write_atomic
from yamlformer.recipes.data.instructions import InstructionData, shuffled
from yamlformer.recipes.data.pairs import PairRows, encode_pairs, pair_sides
from yamlformer.recipes.data.windows import IGNORE
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.learning.module import LMModule
from yamlformer.recipes.parallel.compile import eager
from yamlformer.recipes.parallel.fsdp import is_sharded_model, whole_model
from yamlformer.recipes.say import publish, say
from yamlformer.recipes.tasks.preference.losses import PairLogps, pair_logps, preference_loss
from yamlformer.recipes.tasks.sft.training import (
    BeforeAndAfter,
    checkpoint_recipe,
    record_files,
    split,
    tokenizer_for,
)
from yamlformer.recipes.tasks.task import Prepared
from yamlformer.recipes.trained import load_trained, pretrained_tokenizer, starting_weights


class Pairs:
    """A run's pairs, encoded and packed into rows: training and held-out."""

    def __init__(self, data, recipe_file: Path | None, tokenizer, seed: int):
        train_path, held_path = record_files(data, recipe_file)
        self.chat = ChatFormat(tokenizer, data.chat_template)
        train = encode_pairs(train_path, self.chat, data.seq_len, data.limit)
        if held_path is not None:
            held = encode_pairs(held_path, self.chat, data.seq_len)
        else:
            train, held = split(train, data.val_fraction, seed)
        pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        order = shuffled(len(train), seed, 1)  # packed in a seeded order: a row mixes the file's pairs
        self.train = PairRows([train[i] for i in order], data.seq_len, pad, data.packing)
        self.held = PairRows(held, data.seq_len, pad, data.packing)
        self.line = (
            f"pairs: {len(train):,} training in {len(self.train):,} rows of {data.seq_len} tokens "
            f"({self.train.tokens / (len(self.train) * (data.seq_len + 1)):.0%} filled), {len(held):,} held out; "
            f"{self.chat.describe()}"
        )


# -- the reference model ----------------------------------------------------------------------------

#: the dtype a frozen copy is kept in under mixed precision: the one its matrix products run in
_COMPUTE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class Reference:
    """Where the reference log-probabilities come from: the starting policy, had in the cheapest
    way its model allows. Nowhere for simpo and orpo (they read the policy alone); an adapted model
    whose adapters start as the identity (fresh): the policy with its adapters switched off, no
    second copy; an adapted model whose adapters were loaded trained (a LoRA SFT run's, TRL's
    "ref" adapter): the policy with the adapters' starting values swapped in, a copy of the
    adapters alone; full fine-tuning: a frozen copy of the starting weights, kept in the compute
    dtype. None of them is a parameter of the module, in its state or its checkpoints."""

    def __init__(self, needed: bool):
        self.needed = needed
        self.copy: nn.Module | None = None
        self.adapters_at_start: dict[str, torch.Tensor] | None = None

    def capture(self, model: nn.Module) -> None:
        """Keep what the reference needs of ``model`` as it starts (its loaded weights)."""
        if not self.needed:
            return
        adapters = adapter_parameters(model)
        if not adapters:
            self.copy = copy.deepcopy(model).requires_grad_(False).eval()
        elif not _adapters_are_identity(model):
            self.adapters_at_start = {name: p.detach().clone() for name, p in adapters.items()}

    def place(self, device: torch.device, precision: str) -> None:
        """What was kept on the run's device; a frozen copy in the dtype its products run in
        (``precision``: Lightning's, ``bf16-mixed``...)."""
        if self.copy is not None and not is_sharded_model(self.copy):
            self.copy.to(device=device, dtype=_COMPUTE.get(precision))
        if self.adapters_at_start is not None:
            self.adapters_at_start = {k: v.to(device) for k, v in self.adapters_at_start.items()}

    @contextlib.contextmanager
    def model(self, policy: nn.Module):
        """The reference model for ``policy``'s batch, without gradients."""
        if not self.needed:  # never the policy in its place: a precomputed table missing is a bug
            raise RuntimeError("no reference model is kept (a loss without one, or its log-probabilities precomputed)")
        with torch.no_grad():
            if self.copy is not None:
                yield self.copy
            elif self.adapters_at_start is not None:
                with _swapped(adapter_parameters(policy), self.adapters_at_start):
                    yield policy
            else:
                with adapters_disabled(policy):
                    yield policy


def _adapters_are_identity(model: nn.Module) -> bool:
    """Whether every adapted layer of ``model`` computes its base weight (adapters as they start:
    LoRA's ``B`` zero, DoRA's magnitude the weight's norm), asked of each layer's own merge."""
    with torch.no_grad():
        return all(
            torch.equal(layer.adapted_weight(), layer.dense_weight())
            for layer in linear_layers(model).values()
            if layer.adapter is not None
        )


@contextlib.contextmanager
def _swapped(parameters: dict[str, nn.Parameter], values: dict[str, torch.Tensor]):
    """``parameters`` hold ``values`` within it, their own again after."""
    if any(isinstance(p, DTensor) for p in parameters.values()):
        raise RecipeError("a reference of trained adapters is not sharded here; train on one device or under ddp")
    own = {name: p.detach().clone() for name, p in parameters.items()}
    for name, p in parameters.items():
        p.copy_(values[name])
    try:
        yield
    finally:
        for name, p in parameters.items():
            p.copy_(own[name])


def batch_logps(model: nn.Module, batch, select: bool):
    """The batch's pairs' summed response log-probabilities under ``model``
    (:class:`~yamlformer.recipes.tasks.preference.losses.PairLogps`); ``select``: the head projects
    the scored positions only."""
    inputs, targets, documents, sequences, pairs = batch[:5]
    scored = targets != IGNORE
    options = {} if documents is None else {"document_ids": documents}  # None: a sequence a row
    if select:
        logits = model(inputs, scored=scored, **options)  # (n, vocab)
    else:
        logits = model(inputs, **options)[scored]  # (batch, seq, vocab) -> (n, vocab)
    token_logps = -F.cross_entropy(logits.float(), targets[scored], reduction="none")
    return pair_logps(token_logps, sequences[scored], int(pairs))


def policy_and_reference(model, reference: Reference, objective, batch, select: bool):
    """``(policy, reference)`` log-probabilities of a batch of pairs (``reference`` None for a loss
    without one): the reference's forward first (the policy's is the last, whose auxiliary losses
    a model keeps), or the batch's precomputed reference."""
    precomputed = batch[5] if len(batch) > 5 else None
    ref = None
    if objective.needs_reference() and precomputed is None:
        with reference.model(model) as ref_model:
            ref = batch_logps(ref_model, batch, select)
    policy = batch_logps(model, batch, select)
    if objective.needs_reference() and precomputed is not None:
        ref = PairLogps(precomputed[:, 0], precomputed[:, 1], policy.chosen_tokens, policy.rejected_tokens)
    return policy, ref


def pair_losses(model, reference: Reference, objective, batch, select: bool):
    """``(loss, metrics)`` of a batch of pairs (:func:`policy_and_reference`)."""
    return preference_loss(objective, *policy_and_reference(model, reference, objective, batch, select))


# -- precomputed reference log-probabilities ----------------------------------------------------------

#: bump when what the cached tables hold changes
_TABLE_VERSION = 1


def reference_fingerprint(model: nn.Module, rows: list[PairRows]) -> str:
    """A fingerprint of the encoded pairs of ``rows`` (their tokens, targets, documents and pairs:
    the data, the tokenizer, the template and the packing) and of ``model``'s weights."""
    digest = hashlib.sha256(f"reference-logps v{_TABLE_VERSION}".encode())
    for part in rows:
        for array in (part.ids, part.trained, part.documents, part.sequence):
            digest.update(str(array.shape).encode())
            digest.update(np.ascontiguousarray(array).tobytes())
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


@torch.no_grad()
def rows_reference(model: nn.Module, rows: PairRows, batch: int) -> np.ndarray:
    """``(pairs, 2)`` float32: each pair's summed response log-probabilities (chosen, rejected)
    under ``model`` as it is, in eval mode, ``batch`` rows a forward."""
    select = bool(getattr(model, "scores_positions", lambda: False)())
    table = np.zeros((rows.pairs, 2), dtype=np.float32)
    was_training = model.training
    model.eval()
    with eager():
        for first in range(0, len(rows), batch):
            index = np.arange(first, min(first + batch, len(rows)))
            logps = batch_logps(model, rows.batch(index)[:5], select)
            order = [i for r in index.tolist() for i in rows.records[r]]
            table[order, 0], table[order, 1] = logps.chosen.numpy(), logps.rejected.numpy()
    model.train(was_training)
    return table


def precompute_reference(model: nn.Module, pairs: Pairs, cache_dir: Path, batch: int) -> None:
    """The starting ``model``'s (the reference's) log-probabilities of every training and held-out
    pair, set on their rows (``PairRows.reference``): read from ``cache_dir/reference-logps`` when
    a table of the same fingerprint is there and whole, else computed in one pass and written there
    (one a fingerprint: other data or other starting weights are another table)."""
    fingerprint = reference_fingerprint(model, [pairs.train, pairs.held])
    path = Path(cache_dir) / "reference-logps" / f"{fingerprint}.npz"
    tables = None
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as saved:
                tables = saved["train"], saved["held"]
        except (OSError, ValueError, KeyError, EOFError):
            tables = None  # unreadable (a torn or foreign file): computed again
        shapes = [(rows.pairs, 2) for rows in (pairs.train, pairs.held)]
        whole = tables is not None and [t.shape for t in tables] == shapes and all(np.isfinite(t).all() for t in tables)
        tables = tables if whole else None
        if tables is not None:
            say(f"reference log-probabilities: read from {path}")
    if tables is None:
        tables = rows_reference(model, pairs.train, batch), rows_reference(model, pairs.held, batch)
        buffer = io.BytesIO()
        np.savez(buffer, train=tables[0], held=tables[1])
        write_atomic(path, buffer.getvalue())
        say(f"reference log-probabilities: {pairs.train.pairs + pairs.held.pairs:,} pairs computed, cached at {path}")
    pairs.train.reference, pairs.held.reference = tables


class PreferenceModule(LMModule):
    """The preference loss of :mod:`yamlformer.recipes.tasks.preference.losses` on pairs' rows; its
    metrics (rewards, margins, accuracy, log-probabilities) summed on the device and published
    with the loss at each log step, validation's as ``val_loss`` and ``val_accuracy``."""

    scores_only_targets = True

    def __init__(self, model: nn.Module, recipe, meta: dict, reference: Reference | None = None):
        super().__init__(model, recipe, meta)
        self.objective = recipe.preference
        self.reference = reference or Reference(self.objective.needs_reference())
        self._train_losses = self._losses  # the scored positions vary with the pairs: never compiled whole
        self._sums: dict[str, torch.Tensor] = {}
        self._summed = 0

    def configure_model(self):
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None and self.reference.adapters_at_start is not None:
            raise RecipeError(
                "a reference of adapters loaded trained (model.init_from's) is not sharded here; train it on one "
                "device or under strategy: ddp"
            )
        super().configure_model()
        if parallelize is not None and self.reference.copy is not None:
            self.reference.copy = parallelize(self.reference.copy)  # sharded like the policy

    def on_fit_start(self):
        self.reference.place(self.device, str(self.trainer.precision))

    def on_train_end(self):
        # the held-out pairs are scored at the end on rank 0 alone, with the policy gathered whole
        # (``Prepared.finish``): a sharded frozen copy is gathered too, by every rank, here
        if self.reference.copy is not None and is_sharded_model(self.reference.copy):
            self.reference.copy = whole_model(types.SimpleNamespace(model=self.reference.copy, trainer=self.trainer))

    def _losses(self, *batch):
        loss, metrics = pair_losses(self.model, self.reference, self.objective, batch, self._select_scored)
        if self.training:
            for key, value in metrics.items():
                self._sums[key] = self._sums[key] + value if key in self._sums else value.clone()
            self._summed += 1
        if self.adds_aux_losses:
            for aux in self.model.aux_losses(balance_weight=self.moe_aux_coef).values():
                loss = loss + aux
        self._last_metrics = metrics
        return loss, loss

    def flush_losses(self, log: bool = True) -> bool:
        read = super().flush_losses(log)
        if read and log and self._summed:
            keys = list(self._sums)
            total = self.trainer.strategy.reduce(torch.stack([self._sums[k] for k in keys]), reduce_op="mean")
            publish(self.trainer, {k: v / self._summed for k, v in zip(keys, total.tolist())})
            self._sums, self._summed = {}, 0
        return read

    def validation_step(self, batch, batch_idx):
        loss = self._losses(*batch)[0]
        accuracy = self._last_metrics["rewards/accuracy"]
        pairs = int(batch[4])
        self.log("val_loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True, batch_size=pairs)
        self.log("val_accuracy", accuracy, on_step=False, on_epoch=True, sync_dist=True, batch_size=pairs)
        return loss


# -- held-out pairs -----------------------------------------------------------------------------------


@torch.no_grad()
def held_out_scores(model, reference: Reference, objective, rows: PairRows, batch: int, batches=None) -> dict:
    """Over the held-out rows (the first ``batches`` batches of ``batch`` rows; None: all), per pair:
    the loss, the reward accuracy and margin (``losses``' definitions), and how often the chosen
    answer is the more likely per token (``prefers_chosen``: the policy alone, so a start before any
    training, where every DPO reward is 0, says something too)."""
    was_training = model.training
    model.eval()
    select = bool(getattr(model, "scores_positions", lambda: False)()) and not is_sharded_model(model)
    device = next(model.parameters()).device
    n = len(rows) if batches is None else min(len(rows), batches * batch)
    totals = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0, "prefers_chosen": 0.0}
    pairs = 0
    with eager():
        for first in range(0, n, batch):
            rows_batch = rows.batch(np.arange(first, min(first + batch, n)))
            on_device = tuple(x.to(device) if torch.is_tensor(x) else x for x in rows_batch)
            count = on_device[4]
            policy, ref = policy_and_reference(model, reference, objective, on_device, select)
            loss, metrics = preference_loss(objective, policy, ref)
            chosen, rejected = policy.means()
            totals["loss"] += float(loss) * count
            totals["accuracy"] += float(metrics["rewards/accuracy"]) * count
            totals["margin"] += float(metrics["rewards/margins"]) * count
            totals["prefers_chosen"] += float((chosen > rejected).float().sum())
            pairs += count
    model.train(was_training)
    return {key: value / max(pairs, 1) for key, value in totals.items()} | {"pairs": pairs}


def scores_line(scores: dict) -> str:
    """Held-out scores in one line (before training, and ``builder eval``'s)."""
    return (
        f"loss {scores['loss']:.4f}, reward accuracy {scores['accuracy']:.1%}, margin {scores['margin']:.4f}; "
        f"the chosen answer more likely per token {scores['prefers_chosen']:.1%}"
    )


class HeldOut(BeforeAndAfter):
    """The held-out pairs scored as a run starts and as it ends (:meth:`after`)."""

    def __init__(self, pairs: Pairs, objective, batch: int, batches: int):
        self.pairs, self.objective, self.batch, self.batches = pairs, objective, batch, batches

    def scores(self, model, reference: Reference) -> dict:
        return held_out_scores(model, reference, self.objective, self.pairs.held, self.batch, self.batches)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.before is not None or trainer.global_step or is_sharded_model(pl_module.model):
            return  # a sharded model is scored whole at the end only
        self.before = self.scores(pl_module.model, pl_module.reference)
        if trainer.is_global_zero:
            say(f"held out, before training: {scores_line(self.before)}")

    def after(self, model, reference: Reference) -> dict:
        return self.reported(self.scores(model, reference), _compared, scores_line)


def _compared(b: dict, after: dict) -> str:
    return (
        f"held out ({after['pairs']:,} pairs): reward accuracy {b['accuracy']:.1%} -> {after['accuracy']:.1%}, "
        f"margin {b['margin']:.4f} -> {after['margin']:.4f}, the chosen answer more likely per token "
        f"{b['prefers_chosen']:.1%} -> {after['prefers_chosen']:.1%}, loss {b['loss']:.4f} -> {after['loss']:.4f}"
    )


def prepare(run) -> Prepared:
    """Pairs -> tokenizer -> packed rows (the spec is the run's, checked by the task before); the
    reference model kept as the weights are loaded; the held-out pairs scored before and after."""
    recipe, recipe_file = run.recipe, run.file
    data, settings = recipe.data, recipe.trainer
    train_path, _ = record_files(data, recipe_file)
    tokenizer = tokenizer_for(run, train_path, pair_sides, pretrained_tokenizer(run))
    pairs = Pairs(data, recipe_file, tokenizer, settings.seed)
    say(pairs.line)
    module = InstructionData(
        pairs.train,
        pairs.held,
        data.batch_size,
        settings.seed,
        settings.limit_val_batches,
        settings.accumulate_grad_batches,
    )
    objective = recipe.preference
    reference = Reference(objective.needs_reference() and not objective.precompute_reference)
    init = reference.capture
    if objective.needs_reference() and objective.precompute_reference:

        def init(model):  # the weights as loaded: the starting policy, which is the reference
            precompute_reference(model, pairs, Path(data.cache_dir), data.batch_size)

    held_out = HeldOut(pairs, recipe.preference, data.batch_size, settings.limit_val_batches)

    def module_class(model, recipe, meta):
        return PreferenceModule(model, recipe, meta, reference)

    def finish(lightning_module, model, ckpt_dir: Path) -> dict:
        return held_out.after(model, reference)

    return Prepared(
        tokenizer=tokenizer,
        data=module,
        module_class=module_class,
        seq_len=data.seq_len,
        batch=data.batch_size,
        meta={"pairs": pairs.train.pairs},
        init=init,
        callbacks=lambda ckpt_dir: [held_out],
        finish=finish,
    )


# -- builder eval and builder generate --------------------------------------------------------------


def checkpoint_reference(model, meta: dict) -> Reference:
    """The reference the run of a checkpoint's record (``meta``) compared with: its adapters off,
    or the weights it started from (:func:`yamlformer.recipes.trained.starting_weights`, read
    again; none recorded: its seeded draw)."""
    recipe = checkpoint_recipe(meta)
    reference = Reference(recipe.preference.needs_reference())
    if reference.needed and not adapter_parameters(model):
        device = next(model.parameters()).device
        weights = starting_weights(meta)
        if weights is not None:
            start = load_trained(weights, str(device), folders=True)[0]
        else:
            torch.manual_seed(recipe.trainer.seed)  # as the run drew it (yamlformer.recipes.training.run)
            start = build_model(model.spec, init_seed=recipe.trainer.seed)
        reference.capture(start)
        reference.place(device, "32-true")
    return reference


def evaluate_checkpoint(model, tokenizer, meta: dict, args) -> dict:
    """``builder eval`` on a preference checkpoint: its run's held-out pairs scored (``--max-batches``,
    else the recipe's ``limit_val_batches``; ``--all``)."""
    recipe = checkpoint_recipe(meta)
    pairs = Pairs(recipe.data, Path(meta["recipe_file"]), tokenizer, recipe.trainer.seed)
    batch = args.batch_size or recipe.data.batch_size
    available = math.ceil(len(pairs.held) / batch)
    batches = available if args.all else min(available, args.max_batches or recipe.trainer.limit_val_batches)
    reference = checkpoint_reference(model, meta)
    scores = held_out_scores(model, reference, recipe.preference, pairs.held, batch, batches)
    return {**scores, "batches": batches, "batches_available": available}
