"""``task: lm``'s training side: the corpus, tokenizer and spec of a run and its windows
(:func:`prepare`); ``builder eval`` on an LM checkpoint (the run's validation windows, or
consecutive windows of other text); ``builder generate`` and the samples printed after a run."""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from tqdm.auto import tqdm

from yamlformer.blocks.heads import IGNORE
from yamlformer.recipes.data.corpus import (
    document_tokens,
    held_out_tokens,
    mixture_rows,
    open_corpus,
    over_limit,
    read_text,
)
from yamlformer.recipes.data.tokenizers import build_tokenizer
from yamlformer.recipes.data.windows import LMDataModule, Mixture, ValWindows
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.learning.module import LMModule
from yamlformer.recipes.recipe.sections import DataSection, Recipe
from yamlformer.recipes.say import say
from yamlformer.recipes.tasks.lm.streaming import stream
from yamlformer.recipes.tasks.task import Prepared
from yamlformer.recipes.trained import pretrained_tokenizer


def open_run_corpus(run):
    """The run's sources opened with their tokenizer (:mod:`yamlformer.recipes.data.corpus`): the
    tokenized datasets', the one ``model.init_from`` was trained with, or the recipe's, made from
    the text when it is trained."""

    recipe = run.recipe
    cache = Path(recipe.data.cache_dir)

    def tokenizer_for(text: str, text_hash: str):
        return build_tokenizer(recipe.tokenizer, text, text_hash, cache, run.file)

    corpus = open_corpus(
        recipe.data,
        run.file,
        tokenizer_for,
        run.task.trains_tokenizer(recipe),
        pretrained=pretrained_tokenizer(run),
    )
    say(corpus.line)
    return corpus


def windows(recipe: Recipe, corpus, total_windows: int) -> LMDataModule:
    """The corpus's windows as the run takes them, ``total_windows`` of them over every
    data-parallel rank; refuses a mixture past a source's epoch limit."""

    settings = recipe.trainer
    rows = mixture_rows(corpus, total_windows)
    if len(rows) > 1:
        say("mixture: " + ", ".join(f"{r['name']} {r['share']:.0%} ({r['epochs']:.2f} epochs)" for r in rows))
    problems = over_limit(rows)
    if problems:
        raise RecipeError(problems[0])
    mixture = Mixture(corpus.sources, settings.seed, corpus.tokenizer.vocab_size, recipe.data.packing)
    return LMDataModule(
        mixture,
        recipe.data.batch_size,
        settings.seed,
        settings.limit_val_batches,
        settings.accumulate_grad_batches,
        recipe.data.num_workers,
    )


def prepare(run, samples: bool) -> Prepared:
    """The data stage of an LM run: the corpus's windows and its tokenizer; at the end, the
    recipe's samples when ``samples``."""
    recipe = run.recipe
    corpus = open_run_corpus(run)
    data = windows(recipe, corpus, run.task.total_windows(recipe))
    tokenizer = corpus.tokenizer

    def finish(module, model, ckpt_dir: Path) -> dict:
        if samples and recipe.sample.prompts and recipe.sample.max_new_tokens:
            print_samples(model, tokenizer, recipe)
        return {}

    return Prepared(
        tokenizer=tokenizer,
        data=data,
        module_class=LMModule,
        seq_len=recipe.data.seq_len,
        batch=recipe.data.batch_size,
        meta={"corpus": corpus.hash},
        callbacks=lambda ckpt_dir: harness_callbacks(run),
        finish=finish,
    )


def harness_callbacks(run) -> list:
    """The ``harness:`` section of ``run``'s recipe as a callback (none without one); without
    lm-eval installed, one line naming the section and the extra to install."""
    recipe = run.recipe
    if recipe.harness is None:
        return []
    try:
        # optional extra: lm-eval (pip install 'yamlformer[harness]')
        from yamlformer.recipes.tasks.lm.harness import HarnessCallback
    except ImportError as exc:
        raise RecipeError(f"harness: needs lm-eval ({exc}): pip install 'yamlformer[harness]'") from None
    return [HarnessCallback.from_section(recipe.harness, run.file)]


@torch.no_grad()
def print_samples(model, tokenizer, recipe: Recipe) -> None:
    """Decode each prompt with the recipe's sampling settings and print the text; each prompt
    draws from a generator of its own (:func:`prompt_seed`)."""

    model.eval()
    settings = recipe.sample
    device = next(model.parameters()).device
    for prompt in settings.prompts:
        print(f"\n--- sample: {prompt!r} ---", flush=True)
        generator = torch.Generator(device=device).manual_seed(prompt_seed(recipe.trainer.seed, prompt))
        sys.stdout.write(prompt)
        stream(
            model,
            tokenizer,
            prompt,
            sys.stdout,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            generator=generator,
            compile=settings.compile,
        )
        print(flush=True)


def prompt_seed(seed: int, prompt: str) -> int:
    """The seed a sample prompt draws from: the run's seed and the prompt, hashed. Every prompt
    used to start from the run's seed itself, so all drew the same random numbers, and a model
    whose next-token distribution barely depends on the prompt (early in training) continued two
    different prompts with the same text; a prompt's sample is still repeatable, wherever it is listed."""
    digest = hashlib.sha256(f"{seed}\0{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch takes seeds below 2**63 on every device


def generate(model, tokenizer, args) -> None:
    """``builder generate`` on an LM checkpoint or model folder: the prompt and its continuation,
    streamed to stdout."""

    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
    temperature = 0.0 if args.num_beams > 1 else args.temperature
    sys.stdout.write(args.prompt)
    stream(
        model,
        tokenizer,
        args.prompt,
        sys.stdout,
        args.max_new_tokens,
        temperature=temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_beams=args.num_beams,
        generator=generator,
        compile=bool(args.compile),
    )
    sys.stdout.write("\n")


def evaluate_checkpoint(model, tokenizer, meta: dict, args) -> dict:
    """``builder eval`` on an LM checkpoint: the loss on the run's validation windows, or on
    consecutive windows of ``--data``."""
    if not isinstance(meta.get("recipe"), dict):
        raise RecipeError(
            f"{args.checkpoint} holds no training recipe (its data, batch size and seq_len) to evaluate with"
        )
    data = meta["recipe"]["data"]
    mixture = None
    if args.data:
        tokens = file_tokens(args.data, tokenizer, data["cache_dir"])
    else:
        try:
            tokens, mixture = recipe_tokens(meta, tokenizer)
        except RecipeError as exc:
            raise RecipeError(f"{args.checkpoint}: {exc}") from None
    # on the recipe's data, the windows its validations drew; on other files, consecutive ones
    seed = None if args.data else meta["recipe"]["trainer"]["seed"]
    result = evaluate(
        model,
        tokens,
        args.seq_len or data["seq_len"],
        args.batch_size or data["batch_size"],
        eval_batches(args, meta),
        seed,
        mixture,
    )
    return {"data": args.data or "validation split", **result}


def eval_batches(args, meta: dict) -> int | None:
    """How many batches ``builder eval`` scores: ``--max-batches N``; every batch with ``--all``
    (``None``); else the recipe's ``trainer.limit_val_batches``, the count its validations scored."""
    if getattr(args, "all", False):
        return None
    return args.max_batches or meta["recipe"]["trainer"]["limit_val_batches"]


def recipe_tokens(meta: dict, tokenizer):
    """``(held-out tokens, the run's validation windows)`` of the data the checkpoint was trained on."""

    try:  # the base recipe's sections are what the data path reads (the LM's harness is not)
        recipe = Recipe.model_validate({k: v for k, v in meta["recipe"].items() if k in Recipe.model_fields})
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
    followed by the tokenizer's EOS when it has one; tokenized once and cached in ``cache_dir``
    (:func:`yamlformer.recipes.data.corpus.document_tokens`), not on every eval."""

    text = read_text(paths, DataSection(sources=paths, max_bytes=None, cache_dir=cache_dir), None)
    return document_tokens(text, tokenizer, cache_dir)


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
    run drew from ``mixture`` (:class:`yamlformer.recipes.data.windows.ValWindows`, at the run's seq_len), so the
    loss is that run's validation loss; else consecutive windows of ``tokens`` from the start. A
    progress bar goes to stderr."""

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
