"""``task: lm``: next-token prediction on a corpus; its evaluation (``builder eval`` on an LM
checkpoint: the run's validation windows, or consecutive windows of other text)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from recipes.data.windows import IGNORE, ValWindows
from recipes.recipe.sections import Recipe, RecipeError


def eval_batches(args, meta: dict) -> int | None:
    """How many batches ``builder eval`` scores: ``--max-batches N``; every batch with ``--all``
    (``None``); else the recipe's ``trainer.limit_val_batches``, the count its validations scored."""
    if getattr(args, "all", False):
        return None
    return args.max_batches or meta["recipe"]["trainer"]["limit_val_batches"]


def recipe_tokens(meta: dict, tokenizer):
    """``(held-out tokens, the run's validation windows)`` of the data the checkpoint was trained on."""
    from pydantic import ValidationError

    from recipes.data.corpus import held_out_tokens, open_corpus
    from recipes.data.windows import Mixture

    try:
        recipe = Recipe.model_validate(meta["recipe"])
    except ValidationError as exc:
        first = str(exc).splitlines()[1][:160]
        raise RecipeError(
            f"its recipe does not validate here ({first}); pass --data FILE to evaluate on other text"
        ) from None
    corpus = open_corpus(recipe.data, Path(meta["recipe_file"]), None, False, pretrained=tokenizer)
    mixture = Mixture(corpus.sources, recipe.trainer.seed, tokenizer.vocab_size, recipe.data.packing)
    return held_out_tokens(corpus), mixture


def file_tokens(paths: list[str], tokenizer, cache_dir: str) -> np.ndarray:
    """All the text of ``paths`` (files or folders), tokenized: one document per file, each
    followed by the tokenizer's EOS when it has one."""
    from recipes.data.corpus import read_text
    from recipes.recipe.sections import DataSection

    text = read_text(paths, DataSection(sources=paths, max_bytes=None, cache_dir=cache_dir), None)
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    ids = [i for document in text.texts for i in tokenizer.encode(document) + eos]
    return np.asarray(ids, dtype=np.int64)


def consecutive_windows(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int):
    """The first ``n_batches`` batches of consecutive, non-overlapping windows of ``tokens``."""
    n_windows = min((len(tokens) - 1) // seq_len, n_batches * batch_size)
    for first in range(0, n_windows, batch_size):
        starts = np.arange(first, min(first + batch_size, n_windows)) * seq_len
        rows = starts[:, None] + np.arange(seq_len + 1)  # (batch, seq_len + 1)
        block = torch.from_numpy(tokens[rows].astype(np.int64))
        yield block[:, :-1], block[:, 1:]


@torch.no_grad()
def evaluate(
    model,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    seed: int | None = None,
    mixture=None,
) -> dict:
    """Mean next-token cross-entropy over ``max_batches`` batches of ``tokens`` (``None``: every
    consecutive, non-overlapping window). With ``seed``, the batches are the validation windows a
    run drew from ``mixture`` (:class:`recipes.data.windows.ValWindows`, at the run's seq_len), so the
    loss is that run's validation loss; else consecutive windows of ``tokens`` from the start. A
    progress bar goes to stderr."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise RecipeError(f"{len(tokens)} tokens are fewer than one window of seq_len {seq_len} + 1")
    available = math.ceil(n_windows / batch_size)  # consecutive batches: what --all scores
    if (
        max_batches is not None
        and seed is not None
        and mixture is not None
        and mixture.validation.streams[0].seq_len == seq_len
    ):
        batches, n = ValWindows(mixture, batch_size, max_batches, 0, 1), max_batches
    else:
        n = available if max_batches is None else min(max_batches, available)
        batches = consecutive_windows(tokens, seq_len, batch_size, n)
    total, count = 0.0, 0
    for inputs, targets, *documents in tqdm(batches, total=n, desc="eval", unit="batch", leave=False, file=sys.stderr):
        extra = {"document_ids": documents[0].to(device)} if documents else {}
        logits = model(inputs.to(device), **extra)  # (batch, seq, vocab)
        total += F.cross_entropy(
            logits.flatten(0, 1).float(), targets.to(device).flatten(), reduction="sum", ignore_index=IGNORE
        ).item()
        count += int((targets != IGNORE).sum())
    loss = total / count
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700)),
        "tokens": count,
        "batches": n,
        "batches_available": available,
    }
