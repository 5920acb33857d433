"""``task: classification``'s training side: labelled examples (a CSV or JSON Lines file, a
text file per label, or a dataset's split) in token-budget batches, an encoder from scratch or
from an MLM checkpoint (``classification.init_from``) with a classification head, accuracy and
macro F1."""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from yamlformer.builder.checkpoints import model_weights, not_ours
from yamlformer.recipes.data.batching import BucketDataModule, pad, sorted_batches
from yamlformer.recipes.data.registry import split_files
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import not_a_file, resolve
from yamlformer.recipes.learning.module import LMModule
from yamlformer.recipes.tasks import task_named
from yamlformer.recipes.tasks.mlm.training import Specials, encoder_tokenizer, report
from yamlformer.recipes.tasks.task import Prepared
from yamlformer.recipes.trained import checkpoint_tokenizer, pretrained_tokenizer, read_verified


def read_examples(path: Path, text_field: str, label_field: str) -> list[tuple[str, str]]:
    """``(text, label)`` rows of a .csv (header row) or .jsonl file."""
    why = not_a_file(path)
    if why:
        raise RecipeError(f"{path} {why}")
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
            by_label = split_files(section.dataset, section.split, section.dataset_root(recipe_file))
        else:
            by_label = {label: resolve(recipe_file, file) for label, file in section.by_label.items()}
        examples = []
        for label, path in by_label.items():
            why = not_a_file(path)
            if why:
                raise RecipeError(f"data.by_label.{label}: {path} {why}")
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


def class_labels(section, train: list[tuple[str, str]]) -> list[str]:
    """The label names in id order: ``data.labels``, else the sorted labels of the training examples."""
    return section.labels or sorted({label for _, label in train})


def prepare_classification(run) -> Prepared:
    """The data stage of a classification run: the labelled examples in token-budget batches,
    their tokenizer (``classification.init_from``'s, ``model.init_from``'s or trained on them)
    and the encoder weights to start from."""
    recipe, recipe_file, spec = run.recipe, run.file, run.spec
    data, settings = recipe.data, recipe.classification
    train, val = labelled_examples(data, recipe_file, recipe.trainer.seed)
    init = resolve(recipe_file, settings.init_from) if settings.init_from else None
    if init is not None:
        if not init.exists():
            raise RecipeError(f"classification.init_from: no checkpoint at {init}")

        checkpoint = _init_checkpoint(init)
        meta = checkpoint.get("builder")
        if not isinstance(meta, dict):
            raise RecipeError(
                f"classification.init_from: {not_ours(init, checkpoint)}; start from an mlm run's checkpoint"
            )
        try:
            task_named("mlm").check_meta(meta)
            tokenizer = checkpoint_tokenizer(init, meta.get("tokenizer"))
        except RecipeError as exc:
            named = str(exc) if str(init) in str(exc) else f"{init}: {exc}"
            raise RecipeError(f"classification.init_from: {named}") from None
    elif (pretrained := pretrained_tokenizer(run)) is not None:
        tokenizer = pretrained
    else:
        text = "\n".join(t for t, _ in train)
        tokenizer = encoder_tokenizer(run, text, hashlib.sha256(text.encode()).hexdigest()[:16])
    labels = class_labels(data, train)
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
        tokenizer=tokenizer,
        data=module,
        module_class=ClassifierModule,
        tokens_of=lambda batch: batch[1].sum(),
        seq_len=int(np.median(train_lengths)),
        batch=1,
        meta={"labels": labels, "corpus": _examples_hash(train)},
        init=(lambda model: load_encoder(model, init)) if init is not None else None,
        finish=lambda module, _model, _dir: report(module.val_metrics),
    )


def _examples_hash(examples: list[tuple[str, str]]) -> str:
    """The training examples' content, for a resume to check it trains on the same ones."""
    text = "\n".join(f"{label}\t{text}" for text, label in examples)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# -- builder eval / builder generate ---------------------------------------------------------------


@torch.no_grad()
def predict(
    model, tokenizer, texts: list[str], max_len: int, max_tokens: int = 8192, progress: bool = False
) -> torch.Tensor:
    """Class probabilities ``(len(texts), n_classes)`` (``progress``: a bar on stderr)."""

    device = next(model.parameters()).device
    rows, lengths = encode_examples(tokenizer, [(t, "") for t in texts], [""], max_len)
    out = torch.empty(len(texts), model.spec.head.n_classes)
    batches = sorted_batches(lengths, max(max_tokens, int(lengths.max())))
    for batch in tqdm(batches, desc="eval", unit="batch", leave=False, file=sys.stderr, disable=not progress):
        input_ids, mask, _ = collate_labelled([rows[i] for i in batch], Specials(tokenizer).pad)
        out[torch.as_tensor(batch)] = model(input_ids.to(device), mask.to(device)).float().softmax(-1).cpu()
    return out


def evaluate(model, tokenizer, recipe, meta: dict, args) -> dict:
    """``builder eval``: accuracy and macro F1 on ``--data FILE`` (default: the recipe's validation
    split); ``recipe``: the checkpoint's, validated."""
    model.eval()
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


def generate(model, tokenizer, meta: dict, args) -> str:
    model.eval()
    recipe = meta["recipe"]
    probs = predict(model, tokenizer, [args.prompt], recipe["data"]["max_len"])[0]
    ranked = probs.argsort(descending=True).tolist()
    return "  ".join(f"{meta['labels'][i]} {probs[i]:.3f}" for i in ranked[:5])
