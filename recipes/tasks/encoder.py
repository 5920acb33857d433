"""Encoder recipes: BERT's masked-LM pretraining (``task: mlm``) and sequence classification
fine-tuning (``task: classification``), on the encoder-only specs.

Both use a sentencepiece vocabulary with BERT's specials: ``[PAD]`` 0, ``[UNK]`` 1, ``[CLS]`` 2,
``[SEP]`` 3 and the control symbol ``[MASK]`` (never produced by encoding text). An example is
``[CLS] tokens [SEP]``.

Masking (Devlin et al. 2018, section 3.1): each non-special token is chosen with probability
``mask_prob`` (15%); a chosen token becomes ``[MASK]`` 80% of the time, a random non-special
token 10%, and stays 10%; the loss is on the chosen positions only. The masks of micro-batch
``i`` come from a generator seeded with ``(seed, i)``, so a resumed run masks as an unbroken one.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from recipes.checkpoint import model_weights
from recipes.data.batching import BucketDataModule, pad, sorted_batches
from recipes.data.tokenizers import build_tokenizer
from recipes.data.windows import LMDataModule
from recipes.recipe.sections import RecipeError, model_spec, resolve
from recipes.tasks.base import PROSE, Prepared, check_task
from recipes.tasks.lm import eval_batches
from recipes.training.module import IGNORE, LMModule
from recipes.training.pretrained import pretrained_tokenizer

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
        workers = loader.num_workers
        return DataLoader(
            data,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=4 if workers else None,
            worker_init_fn=loader.worker_init_fn,
        )

    def train_dataloader(self):
        return self._masked(super().train_dataloader(), 0, self.micro_batches_taken())

    def val_dataloader(self):
        return self._masked(super().val_dataloader(), 1, 0)


def masked_tokens(batch) -> int:
    return int(batch[0].numel())


class MLMModule(LMModule):
    """Cross-entropy on the masked positions (``LMModule`` as it is); validation adds their accuracy."""

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


def encoder_tokenizer(recipe, recipe_file: Path, text: str, corpus_hash: str):
    """A prose vocabulary (words, not whitespace runs: BERT's tokenizer folds whitespace too) with
    BERT's specials, trained on ``text`` and cached."""
    options = {**PROSE, **SPECIALS}
    return build_tokenizer(recipe.tokenizer, text, corpus_hash, Path(recipe.data.cache_dir), recipe_file, options)


def _encoder_spec(recipe, recipe_file: Path, vocab_size: int, extra: dict | None = None):
    spec = model_spec(recipe, recipe_file, vocab_size, extra)
    if spec.architecture != "encoder-only":
        raise RecipeError(f"model: task {recipe.task} trains an encoder-only model; {spec.name} is {spec.architecture}")
    return spec


def prepare_mlm(recipe, recipe_file: Path) -> Prepared:
    from recipes.data.corpus import open_corpus
    from recipes.data.windows import Mixture

    if recipe.data.packing != "concat":
        raise RecipeError(
            f"data.packing {recipe.data.packing}: the mlm task frames each window as [CLS] window [SEP]; use concat"
        )
    section = recipe.data.model_copy(update={"seq_len": recipe.data.seq_len - 2})  # [CLS] and [SEP] added
    corpus = open_corpus(
        section,
        recipe_file,
        lambda text, digest: encoder_tokenizer(recipe, recipe_file, text, digest),
        recipe.tokenizer.model_file is None,
        pretrained=pretrained_tokenizer(recipe, recipe_file),
    )
    tokenizer = corpus.tokenizer
    spec = _encoder_spec(recipe, recipe_file, tokenizer.vocab_size)
    if not type(spec.head).projects_to_vocab:
        raise RecipeError(
            f"model: masked-LM pretraining needs a head of type mlm (or lm), one that projects to "
            f"the vocabulary; {spec.name} has {spec.head.type}"
        )
    if recipe.data.seq_len > spec.max_seq_len:
        raise RecipeError(
            f"data.seq_len {recipe.data.seq_len} is longer than the model's max_seq_len {spec.max_seq_len}"
        )
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
        tokenizer,
        spec,
        data,
        MLMModule,
        masked_tokens,
        recipe.data.seq_len,
        meta={"corpus": corpus.hash},
        finish=lambda module, _model, _dir: _report(module.val_metrics),
    )


# -- classification ---------------------------------------------------------------------------------


def read_examples(path: Path, text_field: str, label_field: str) -> list[tuple[str, str]]:
    """``(text, label)`` rows of a .csv (header row) or .jsonl file."""
    if not path.is_file():
        raise RecipeError(f"no file at {path}")
    if path.suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    elif path.suffix in (".jsonl", ".json"):
        lines = path.read_text(encoding="utf-8").split("\n")
        rows = [json.loads(line) for line in lines if line.strip()]
    else:
        raise RecipeError(f"{path}: examples come as .csv (with a header) or .jsonl")
    for n, row in enumerate(rows, 1):
        if text_field not in row or label_field not in row:
            raise RecipeError(
                f"{path}: example {n} has no {text_field!r} or {label_field!r} field "
                f"(it has {sorted(row)}); set data.text_field / data.label_field"
            )
    return [(str(row[text_field]), str(row[label_field])) for row in rows]


def labelled_examples(section, recipe_file: Path | None, seed: int) -> tuple[list, list]:
    """The training and validation ``(text, label)`` examples a recipe's data section names."""
    if section.file is not None:
        examples = read_examples(resolve(recipe_file, section.file), section.text_field, section.label_field)
    else:
        if section.dataset is not None:  # each file of the split is one label (multi30k: the language)
            from recipes.data.registry import split_files

            by_label = split_files(section.dataset, section.split, section.dataset_root(recipe_file))
        else:
            by_label = {label: resolve(recipe_file, file) for label, file in section.by_label.items()}
        examples = []
        for label, path in by_label.items():
            if not path.is_file():
                raise RecipeError(f"data.by_label.{label}: no file at {path}")
            examples += [(line.strip(), label) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    examples = [examples[i] for i in np.random.default_rng([seed, 11]).permutation(len(examples))]
    if section.validation is not None:
        val = read_examples(resolve(recipe_file, section.validation), section.text_field, section.label_field)
        return examples[: section.limit], val
    examples = examples[: section.limit]
    cut = len(examples) - max(1, int(len(examples) * section.val_fraction))
    return examples[:cut], examples[cut:]


def encode_examples(tokenizer, examples, labels: list[str], max_len: int) -> tuple[list, np.ndarray]:
    s = Specials(tokenizer)
    index = {name: i for i, name in enumerate(labels)}
    unknown = sorted({label for _, label in examples} - set(index))
    if unknown:
        raise RecipeError(
            f"labels {unknown[:5]} are not among the training labels {labels[:10]}; list them in data.labels"
        )
    ids = tokenizer.sp.encode([text for text, _ in examples])
    rows = [
        (np.array([s.cls, *row[: max_len - 2], s.sep], dtype=np.int32), index[label])
        for row, (_, label) in zip(ids, examples)
    ]
    return rows, np.array([len(r[0]) for r in rows], dtype=np.int64)


def collate_labelled(rows, pad_id: int):
    input_ids = pad([r[0] for r in rows], pad_id)  # (batch, seq)
    return input_ids, input_ids != pad_id, torch.tensor([r[1] for r in rows])


def classification_metrics(predictions: torch.Tensor, labels: torch.Tensor, n_classes: int) -> dict:
    """Accuracy and macro F1 (the mean F1 over the classes that occur in labels or predictions)."""
    accuracy = (predictions == labels).float().mean().item()
    f1s = []
    for c in range(n_classes):
        tp = int(((predictions == c) & (labels == c)).sum())
        predicted, actual = int((predictions == c).sum()), int((labels == c).sum())
        if predicted or actual:
            f1s.append(2 * tp / (predicted + actual))
    return {"accuracy": accuracy, "macro_f1": float(np.mean(f1s)) if f1s else 0.0}


class ClassifierModule(LMModule):
    """Cross-entropy on one label per sequence; validation reports accuracy and macro F1."""

    variable_shapes = True  # token-budget buckets

    def __init__(self, model, recipe, meta):
        super().__init__(model, recipe, meta)
        self.val_metrics: dict[str, float] = {}
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def logits_and_targets(self, input_ids, attention_mask, labels):
        return self.model(input_ids, attention_mask), labels  # (batch, n_classes), (batch,)

    def validation_step(self, batch, batch_idx):
        logits, labels = self.logits_and_targets(*batch)
        self._seen.append((logits.argmax(-1).cpu(), labels.cpu()))
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self):
        super().on_validation_epoch_end()
        if self._seen:
            predictions, labels = (torch.cat(t) for t in zip(*self._seen))
            self._seen = []
            self.val_metrics = classification_metrics(predictions, labels, len(self.meta["labels"]))
            self.log("val_acc", self.val_metrics["accuracy"], prog_bar=True)
            self.log("val_f1", self.val_metrics["macro_f1"], prog_bar=True)


def _init_checkpoint(path: Path) -> dict:
    """``classification.init_from``, read safely and verified; its errors name the field."""
    from recipes.checkpoint import read_verified

    try:
        return read_verified(path)
    except RecipeError as exc:
        raise RecipeError(f"classification.init_from: {exc}") from None


def load_encoder(model, path: Path) -> None:
    """The ``encoder.*`` weights of a checkpoint (an MLM run) into ``model``; the head stays new."""
    state = _init_checkpoint(path).get("state_dict") or {}
    state = {k: v for k, v in model_weights(state).items() if k.startswith("encoder.")}
    own = model.state_dict()
    wrong = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
    if wrong or not state:
        raise RecipeError(
            f"classification.init_from {path}: its encoder does not fit this spec "
            f"({wrong[:3] or 'no encoder weights'}); use the spec it was trained with"
        )
    missing = [k for k in own if k.startswith("encoder.") and k not in state]
    if missing:
        raise RecipeError(f"classification.init_from {path}: it lacks {missing[:3]}")
    model.load_state_dict(state, strict=False)


def prepare_classification(recipe, recipe_file: Path) -> Prepared:
    data, settings = recipe.data, recipe.classification
    train, val = labelled_examples(data, recipe_file, recipe.trainer.seed)
    init = resolve(recipe_file, settings.init_from) if settings.init_from else None
    if init is not None:
        if not init.exists():
            raise RecipeError(f"classification.init_from: no checkpoint at {init}")
        from recipes.checkpoint import _checkpoint_tokenizer

        checkpoint = _init_checkpoint(init)
        meta = checkpoint.get("builder")
        if not isinstance(meta, dict):
            from builder.integrity import not_ours

            raise RecipeError(
                f"classification.init_from: {not_ours(init, checkpoint)}; start from an mlm run's checkpoint"
            )
        try:
            check_task(meta, "mlm")
            tokenizer = _checkpoint_tokenizer(init, meta.get("tokenizer"))
        except RecipeError as exc:
            named = str(exc) if str(init) in str(exc) else f"{init}: {exc}"
            raise RecipeError(f"classification.init_from: {named}") from None
    elif (pretrained := pretrained_tokenizer(recipe, recipe_file)) is not None:
        tokenizer = pretrained
    else:
        text = "\n".join(t for t, _ in train)
        tokenizer = encoder_tokenizer(recipe, recipe_file, text, hashlib.sha256(text.encode()).hexdigest()[:16])
    labels = data.labels or sorted({label for _, label in train})
    head = {
        "type": "classification",
        "n_classes": len(labels),
        "pooling": settings.pooling,
        "pooler": settings.pooler,
        "dropout": settings.dropout,
    }
    spec = _encoder_spec(recipe, recipe_file, tokenizer.vocab_size, {"head": head})
    max_len = min(data.max_len, spec.max_seq_len)
    train_rows, train_lengths = encode_examples(tokenizer, train, labels, max_len)
    val_rows, val_lengths = encode_examples(tokenizer, val, labels, max_len)
    print(
        f"examples: {len(train_rows):,} training, {len(val_rows):,} validation; {len(labels)} labels "
        f"{labels[:8]}{' ...' if len(labels) > 8 else ''}",
        flush=True,
    )
    module = BucketDataModule(
        train_rows,
        train_lengths,
        val_rows,
        val_lengths,
        functools.partial(collate_labelled, pad_id=Specials(tokenizer).pad),
        data.max_tokens,
        recipe.trainer.seed,
        recipe.trainer.accumulate_grad_batches,
    )
    return Prepared(
        tokenizer,
        spec,
        module,
        ClassifierModule,
        lambda batch: batch[1].sum(),
        int(np.median(train_lengths)),
        meta={"labels": labels, "corpus": _examples_hash(train)},
        init=(lambda model: load_encoder(model, init)) if init is not None else None,
        finish=lambda module, _model, _dir: _report(module.val_metrics),
    )


def _examples_hash(examples: list[tuple[str, str]]) -> str:
    """The training examples' content, for a resume to check it trains on the same ones."""
    text = "\n".join(f"{label}\t{text}" for text, label in examples)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _report(metrics: dict) -> dict:
    print("validation: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
    return {"final": dict(metrics)}


def prepare(recipe, recipe_file: Path) -> Prepared:
    return prepare_mlm(recipe, recipe_file) if recipe.task == "mlm" else prepare_classification(recipe, recipe_file)


# -- builder eval / builder generate ---------------------------------------------------------------


@torch.no_grad()
def predict(
    model, tokenizer, texts: list[str], max_len: int, max_tokens: int = 8192, progress: bool = False
) -> torch.Tensor:
    """Class probabilities ``(len(texts), n_classes)`` (``progress``: a bar on stderr)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    rows, lengths = encode_examples(tokenizer, [(t, "") for t in texts], [""], max_len)
    out = torch.empty(len(texts), model.spec.head.n_classes)
    batches = sorted_batches(lengths, max(max_tokens, int(lengths.max())))
    for batch in tqdm(batches, desc="eval", unit="batch", leave=False, file=sys.stderr, disable=not progress):
        input_ids, mask, _ = collate_labelled([rows[i] for i in batch], Specials(tokenizer).pad)
        out[torch.as_tensor(batch)] = model(input_ids.to(device), mask.to(device)).float().softmax(-1).cpu()
    return out


def evaluate(model, tokenizer, meta: dict, args) -> dict:
    """Classification: accuracy and macro F1 on ``--data FILE`` (default: the recipe's validation
    split); MLM: masked-token loss and accuracy on the recipe's validation windows."""
    from recipes.recipe.task_sections import ClassificationRecipe, MLMRecipe

    check_task(meta, "mlm", "classification")
    model.eval()
    if meta["task"] == "mlm":
        recipe = MLMRecipe.model_validate(meta["recipe"])
        from recipes.data.corpus import held_out_tokens, open_corpus

        section = recipe.data.model_copy(update={"seq_len": recipe.data.seq_len - 2})
        val = held_out_tokens(open_corpus(section, Path(meta["recipe_file"]), None, False, pretrained=tokenizer))
        return masked_lm_metrics(model, tokenizer, val, recipe, eval_batches(args, meta))
    recipe = ClassificationRecipe.model_validate(meta["recipe"])
    labels = meta["labels"]
    if args.data:
        examples = read_examples(Path(args.data[0]), recipe.data.text_field, recipe.data.label_field)
    else:
        examples = labelled_examples(recipe.data, Path(meta["recipe_file"]), recipe.trainer.seed)[1]
    probs = predict(model, tokenizer, [t for t, _ in examples], recipe.data.max_len, progress=True)
    index = {name: i for i, name in enumerate(labels)}
    unknown = sorted({label for _, label in examples} - set(index))
    if unknown:
        raise RecipeError(f"labels {unknown[:5]} are not among the checkpoint's labels {labels[:10]}")
    truth = torch.tensor([index[label] for _, label in examples])
    return {"examples": len(examples), **classification_metrics(probs.argmax(-1), truth, len(labels))}


@torch.no_grad()
def masked_lm_metrics(model, tokenizer, tokens: np.ndarray, recipe, max_batches: int | None) -> dict:
    """Masked-token cross-entropy and accuracy over the first ``max_batches`` batches of
    consecutive windows (``None``: all of them), with seeded masks; a progress bar on stderr."""
    import torch.nn.functional as F
    from tqdm.auto import tqdm

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


def generate(model, tokenizer, meta: dict, args) -> str:
    check_task(meta, "classification")
    model.eval()
    recipe = meta["recipe"]
    probs = predict(model, tokenizer, [args.prompt], recipe["data"]["max_len"])[0]
    ranked = probs.argsort(descending=True).tolist()
    return "  ".join(f"{meta['labels'][i]} {probs[i]:.3f}" for i in ranked[:5])
