"""``task: mlm``'s training side: BERT's masked-LM pretraining on windows of a corpus, and
what every encoder task shares (the vocabulary's specials, the tokenizer, the spec check).

The vocabulary is sentencepiece with BERT's specials: ``[PAD]`` 0, ``[UNK]`` 1, ``[CLS]`` 2,
``[SEP]`` 3 and the control symbol ``[MASK]`` (never produced by encoding text). An example is
``[CLS] tokens [SEP]``.

Masking (Devlin et al. 2018, section 3.1): each non-special token is chosen with probability
``mask_prob`` (15%); a chosen token becomes ``[MASK]`` 80% of the time, a random non-special
token 10%, and stays 10%; the loss is on the chosen positions only. The masks of micro-batch
``i`` come from a generator seeded with ``(seed, i)``, so a resumed run masks as an unbroken one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset
from tqdm.auto import tqdm

from yamlformer.blocks.heads import IGNORE
from yamlformer.recipes.data.corpus import held_out_tokens, open_corpus
from yamlformer.recipes.data.tokenizers import build_tokenizer
from yamlformer.recipes.data.windows import LMDataModule, Mixture
from yamlformer.recipes.data.windows import loader as batch_loader
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.learning.module import LMModule
from yamlformer.recipes.tasks.lm.training import eval_batches
from yamlformer.recipes.tasks.task import PROSE, Prepared
from yamlformer.recipes.trained import pretrained_tokenizer

SPECIALS = {
    "pad_id": 0,
    "unk_id": 1,
    "bos_id": 2,
    "eos_id": 3,
    "pad_piece": "[PAD]",
    "unk_piece": "[UNK]",
    "bos_piece": "[CLS]",
    "eos_piece": "[SEP]",
    "control_symbols": "[MASK]",
}


class Specials:
    """The special ids of an encoder tokenizer."""

    def __init__(self, tokenizer):
        sp = tokenizer.sp
        self.pad, self.cls, self.sep, self.unk = sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()
        self.mask = sp.piece_to_id("[MASK]")
        if min(self.pad, self.cls, self.sep) < 0 or self.mask == self.unk:
            raise RecipeError(
                "this tokenizer lacks BERT's [PAD], [CLS], [SEP] or [MASK]; use one trained by "
                "an mlm or classification recipe"
            )
        self.vocab_size = tokenizer.vocab_size
        self.ids = torch.tensor(sorted({self.pad, self.cls, self.sep, self.unk, self.mask}))
        self.ordinary = torch.tensor([i for i in range(self.vocab_size) if i not in set(self.ids.tolist())])


def mask_tokens(
    ids: torch.Tensor,
    specials: Specials,
    generator: torch.Generator,
    mask_prob: float = 0.15,
    replace_mask: float = 0.8,
    replace_random: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` for masked-LM training: labels hold the chosen tokens, ``IGNORE`` elsewhere."""
    candidates = ~torch.isin(ids, specials.ids)
    chosen = (torch.rand(ids.shape, generator=generator) < mask_prob) & candidates
    if not chosen.any() and candidates.any():  # a loss needs one target at least
        chosen.view(-1)[candidates.view(-1).nonzero()[0]] = True
    how = torch.rand(ids.shape, generator=generator)
    to_mask = chosen & (how < replace_mask)
    to_random = chosen & (how >= replace_mask) & (how < replace_mask + replace_random)
    random_ids = specials.ordinary[torch.randint(len(specials.ordinary), ids.shape, generator=generator)]
    inputs = torch.where(to_mask, specials.mask, ids)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, torch.where(chosen, ids, IGNORE)


class MaskedWindows(IterableDataset):
    """Windows of an LM dataset as ``[CLS] window [SEP]``, masked; micro-batch ``i`` (counted from
    ``first``) masked with a generator seeded by ``(seed, stream, rank, i)``."""

    def __init__(self, windows, specials: Specials, settings, seed: int, stream: int, rank: int, first: int):
        self.windows, self.specials, self.settings = windows, specials, settings
        self.seed, self.stream, self.rank, self.first = seed, stream, rank, first

    def __len__(self):
        return len(self.windows)

    def __iter__(self):
        s = self.specials
        for index, (x, _) in enumerate(self.windows, self.first):
            column = torch.ones(x.shape[0], 1, dtype=x.dtype)
            ids = torch.cat((column * s.cls, x, column * s.sep), dim=1)  # (batch, seq_len)
            seed = int(np.random.default_rng([self.seed, self.stream, self.rank, index]).integers(1 << 62))
            generator = torch.Generator().manual_seed(seed)
            yield mask_tokens(
                ids, s, generator, self.settings.mask_prob, self.settings.replace_mask, self.settings.replace_random
            )


class MLMDataModule(LMDataModule):
    """The LM's windows (two tokens shorter, for [CLS] and [SEP]), masked."""

    def __init__(
        self, mixture, batch_size, seed, val_batches, accumulate, specials: Specials, settings, num_workers: int = 1
    ):
        super().__init__(mixture, batch_size, seed, val_batches, accumulate, num_workers)
        self.specials, self.settings = specials, settings

    def _masked(self, loader: DataLoader, stream: int, first: int) -> DataLoader:
        rank, _ = self._rank()
        data = MaskedWindows(loader.dataset, self.specials, self.settings, self.seed, stream, rank, first)
        return batch_loader(data, self.trainer, loader.num_workers, loader.worker_init_fn)

    def train_dataloader(self):
        return self._masked(super().train_dataloader(), 0, self.micro_batches_taken())

    def val_dataloader(self):
        return self._masked(super().val_dataloader(), 1, 0)


def masked_tokens(batch) -> int:
    return int(batch[0].numel())


class MLMModule(LMModule):
    """Cross-entropy on the masked positions (``LMModule`` as it is; the head projects only those);
    validation adds their accuracy."""

    scores_only_targets = True

    def __init__(self, model, recipe, meta):
        super().__init__(model, recipe, meta)
        self.val_metrics: dict[str, float] = {}

    def validation_step(self, batch, batch_idx):
        inputs, labels = batch
        logits = self.model(inputs)  # (batch, seq, vocab)
        chosen = labels != IGNORE
        hits = (logits.argmax(-1) == labels)[chosen].float()
        self.log("val_acc", hits.mean(), prog_bar=True, on_epoch=True, batch_size=int(chosen.sum()))
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self):
        super().on_validation_epoch_end()
        if "val_acc" in self.trainer.callback_metrics:
            self.val_metrics = {"masked_accuracy": float(self.trainer.callback_metrics["val_acc"])}


def encoder_tokenizer(located, text: str, corpus_hash: str):
    """A prose vocabulary (words, not whitespace runs: BERT's tokenizer folds whitespace too) with
    BERT's specials, trained on ``text`` and cached; ``located``: the recipe as loaded (or the
    ``Run``), whose tokenizer settings and file it reads."""
    recipe, options = located.recipe, {**PROSE, **SPECIALS}
    return build_tokenizer(recipe.tokenizer, text, corpus_hash, Path(recipe.data.cache_dir), located.file, options)


def prepare_mlm(run) -> Prepared:
    """The data stage of a masked-LM run: the corpus's windows, masked, and its tokenizer."""

    recipe = run.recipe
    corpus = open_corpus(
        run.task.corpus_section(recipe),
        run.file,
        lambda text, digest: encoder_tokenizer(run, text, digest),
        run.task.trains_tokenizer(recipe),
        pretrained=pretrained_tokenizer(run),
    )
    tokenizer = corpus.tokenizer
    print(corpus.line, flush=True)
    settings = recipe.trainer
    mixture = Mixture(corpus.sources, settings.seed, tokenizer.vocab_size)
    data = MLMDataModule(
        mixture,
        recipe.data.batch_size,
        settings.seed,
        settings.limit_val_batches,
        settings.accumulate_grad_batches,
        Specials(tokenizer),
        recipe.mlm,
        recipe.data.num_workers,
    )
    return Prepared(
        tokenizer=tokenizer,
        data=data,
        module_class=MLMModule,
        tokens_of=masked_tokens,
        seq_len=recipe.data.seq_len,
        batch=1,
        meta={"corpus": corpus.hash},
        finish=lambda module, _model, _dir: report(module.val_metrics),
    )


def report(metrics: dict) -> dict:
    print("validation: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
    return {"final": dict(metrics)}


# -- builder eval -------------------------------------------------------------------------------------


def evaluate(model, tokenizer, recipe, meta: dict, args) -> dict:
    """``builder eval``: masked-token loss and accuracy on the recipe's validation windows;
    ``recipe``: the checkpoint's, validated."""

    model.eval()
    section = recipe.data.model_copy(update={"seq_len": recipe.data.seq_len - 2})
    val = held_out_tokens(open_corpus(section, Path(meta["recipe_file"]), None, False, pretrained=tokenizer))
    return masked_lm_metrics(model, tokenizer, val, recipe, eval_batches(args, meta))


@torch.no_grad()
def masked_lm_metrics(model, tokenizer, tokens: np.ndarray, recipe, max_batches: int | None) -> dict:
    """Masked-token cross-entropy and accuracy over the first ``max_batches`` batches of
    consecutive windows (``None``: all of them), with seeded masks; a progress bar on stderr."""

    s, width, size = Specials(tokenizer), recipe.data.seq_len - 2, recipe.data.batch_size
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(recipe.trainer.seed)
    total, hits, count = 0.0, 0, 0
    starts = np.arange(0, len(tokens) - width, width)
    available = -(-len(starts) // size)  # ceil: consecutive batches, what --all scores
    starts = starts[: None if max_batches is None else max_batches * size]
    n = -(-len(starts) // size)
    for first in tqdm(range(0, len(starts), size), total=n, desc="eval", unit="batch", leave=False, file=sys.stderr):
        rows = starts[first : first + size, None] + np.arange(width)  # (batch, width)
        x = torch.from_numpy(tokens[rows].astype(np.int64))
        column = torch.ones(x.shape[0], 1, dtype=torch.long)
        inputs, labels = mask_tokens(
            torch.cat((column * s.cls, x, column * s.sep), 1),
            s,
            generator,
            recipe.mlm.mask_prob,
            recipe.mlm.replace_mask,
            recipe.mlm.replace_random,
        )
        logits = model(inputs.to(device)).float().cpu()  # (batch, seq, vocab)
        chosen = labels != IGNORE
        total += F.cross_entropy(logits[chosen], labels[chosen], reduction="sum").item()
        hits += int((logits.argmax(-1) == labels)[chosen].sum())
        count += int(chosen.sum())
    if not count:
        raise RecipeError("no validation windows to evaluate")
    return {
        "masked_tokens": count,
        "loss": total / count,
        "masked_accuracy": hits / count,
        "batches": n,
        "batches_available": available,
    }
