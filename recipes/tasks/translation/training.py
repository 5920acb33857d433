"""``task: translation``: the original Transformer's task, trained and scored for real.

Parallel text (one sentence a line; ``source`` and ``target`` files for training and
validation) -> a joint sentencepiece vocabulary trained on both sides (cached by content hash;
pad 0, unk 1, bos 2, eos 3) -> token-budget batches of like lengths (``yamlformer.recipes.data.batching``) -> an
encoder-decoder trained with label-smoothed cross-entropy on the target tokens, padding masked
in the encoder, the decoder and cross-attention -> beam search and sacreBLEU / chrF.

A batch is ``(src, src_mask, tgt_in, tgt_mask, tgt_out)``: the source ids ending in eos, the
target fed to the decoder (bos first) and the ids it predicts (eos last, ``IGNORE`` on padding).
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
from sacrebleu.metrics import BLEU, CHRF
from tqdm.auto import tqdm

from yamlformer.blocks.heads import IGNORE
from yamlformer.builder import checkpoints
from yamlformer.builder.checkpoints import model_weights
from yamlformer.recipes.data.batching import BucketDataModule, pad, sorted_batches
from yamlformer.recipes.data.registry import get, split_files
from yamlformer.recipes.data.tokenizers import SentencePieceTokenizer, build_tokenizer
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import not_a_file, resolve
from yamlformer.recipes.learning.module import LMModule
from yamlformer.recipes.parallel import whole_model
from yamlformer.recipes.parallel.checkpoints import run_errors
from yamlformer.recipes.tasks.task import PROSE, Prepared
from yamlformer.recipes.trained import pretrained_tokenizer, read_verified

#: sentencepiece ids of the specials (the model's padding, decoder start and end of sentence)
SPECIALS = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}


def read_lines(path: Path) -> list[str]:
    """The file's lines, stripped (only ``\n`` ends a line: sentences may hold other breaks)."""
    why = not_a_file(path)
    if why:
        raise RecipeError(f"{path} {why}")
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.strip() for line in lines]


def read_pairs(source: Path, target: Path, limit: int | None = None) -> tuple[list[str], list[str]]:
    """Line-aligned sentences of two files (the first ``limit`` pairs)."""
    src, tgt = read_lines(source), read_lines(target)
    if len(src) != len(tgt):
        raise RecipeError(f"{source} has {len(src)} lines but {target} has {len(tgt)}; they must align line by line")
    return src[:limit], tgt[:limit]


def special_ids(tokenizer) -> tuple[int, int, int]:
    """``(pad, bos, eos)`` of a translation tokenizer."""
    sp = tokenizer.sp
    ids = sp.pad_id(), sp.bos_id(), sp.eos_id()
    if min(ids) < 0:
        raise RecipeError("this tokenizer has no pad, bos or eos id; translation trains its own (see SPECIALS)")
    return ids


def encode_pairs(tokenizer, src: list[str], tgt: list[str]) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """``(source ids + eos, target ids)`` per pair, and each pair's padded cost in tokens."""
    _, _, eos = special_ids(tokenizer)
    src_ids, tgt_ids = tokenizer.sp.encode(src), tokenizer.sp.encode(tgt)
    pairs = [(np.array(s + [eos], dtype=np.int32), np.array(t, dtype=np.int32)) for s, t in zip(src_ids, tgt_ids)]
    lengths = np.array([max(len(s), len(t) + 1) for s, t in pairs], dtype=np.int64)
    return pairs, lengths


def collate(pairs, pad_id: int, bos: int, eos: int):
    """Sentence pairs -> ``(src, src_mask, tgt_in, tgt_mask, tgt_out)``, right-padded."""
    src = pad([p[0] for p in pairs], pad_id)  # (batch, src_len)
    tgt_in = pad([[bos, *p[1]] for p in pairs], pad_id)  # (batch, tgt_len)
    tgt_out = pad([[*p[1], eos] for p in pairs], IGNORE)  # (batch, tgt_len)
    return src, src != pad_id, tgt_in, tgt_out != IGNORE, tgt_out


def tokens_of(batch) -> torch.Tensor:
    """Real source and target tokens of a batch (a device tensor: read at log intervals only)."""
    return batch[1].sum() + batch[3].sum()


class KeepLastCheckpoints(L.Callback):
    """Weights every ``every_n_steps`` optimizer steps (and at the end) as ``step-N.ckpt``, the last
    ``keep`` of them kept; at the end of training their average goes to ``averaged.ckpt``
    (:mod:`yamlformer.builder.checkpoints.averaging`)."""

    def __init__(self, dirpath: Path, keep: int, every_n_steps: int):
        self.dirpath, self.keep, self.every_n_steps = Path(dirpath), keep, every_n_steps
        self.averaged_path = self.dirpath / "averaged.ckpt"

    def _save(self, trainer) -> None:
        path = checkpoints.step_path(self.dirpath, trainer.global_step)
        if checkpoints.exists(path):
            return
        trainer.save_checkpoint(path, weights_only=True)
        if trainer.is_global_zero:
            for old in checkpoints.kept_checkpoints(self.dirpath)[: -self.keep]:
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if stepped and trainer.global_step % self.every_n_steps == 0:
            self._save(trainer)

    def on_train_end(self, trainer, pl_module):
        if trainer.global_step == 0:
            return
        self._save(trainer)
        if trainer.is_global_zero:
            with run_errors():
                checkpoints.average_checkpoints(checkpoints.kept_checkpoints(self.dirpath), self.averaged_path)


# -- decoding and scoring -------------------------------------------------------------------------


@torch.no_grad()
def translate(
    model,
    tokenizer,
    sources: list[str],
    num_beams: int = 1,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    max_tokens: int = 6000,
    progress: bool = False,
) -> list[str]:
    """Decode ``sources`` (greedy for ``num_beams=1``); the batches hold like lengths (``progress``:
    a bar of sentences on stderr)."""

    pad_id, bos, eos = special_ids(tokenizer)
    device = next(model.parameters()).device
    limit = model.spec.max_seq_len if getattr(model, "spec", None) is not None else None
    ids = [tokenizer.sp.encode(s)[: limit - 1 if limit else None] + [eos] for s in sources]  # the start kept
    lengths = np.array([len(i) for i in ids])
    out: list[str] = [""] * len(sources)
    bar = tqdm(
        total=len(sources), desc="translating", unit="sentence", leave=False, file=sys.stderr, disable=not progress
    )
    for batch in sorted_batches(lengths, max(max_tokens // num_beams, int(lengths.max()))):
        bar.update(len(batch))
        src = pad([ids[i] for i in batch], pad_id).to(device)  # (batch, src_len)
        new = int(max_len_a * src.shape[1] + max_len_b)
        new = min(new, limit - 1) if limit else new
        rows = model.generate(
            src,
            new,
            attention_mask=src != pad_id,
            num_beams=num_beams,
            length_penalty=length_penalty,
            eos_token_id=eos,
            pad_token_id=pad_id,
            decoder_start_token_id=bos,
            vocab_size=tokenizer.vocab_size,  # never an embedding padding row: it would not decode
        )
        for i, row in zip(batch, rows[:, 1:].tolist()):
            out[i] = tokenizer.decode(row[: row.index(eos)] if eos in row else row)
    bar.close()
    return out


def score(hypotheses: list[str], references: list[str]) -> dict:
    """sacreBLEU (13a tokenization, cased) and chrF of detokenized text, with their signatures."""

    bleu, chrf = BLEU(), CHRF()
    b, c = bleu.corpus_score(hypotheses, [references]), chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": b.score,
        "chrf": c.score,
        "bleu_text": str(b),
        "chrf_text": str(c),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


def print_scores(result: dict, what: str) -> None:
    print(f"{what}: sacreBLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f}", flush=True)
    print(f"  {result['bleu_text']}  ({result['bleu_signature']})", flush=True)
    print(f"  {result['chrf_text']}  ({result['chrf_signature']})", flush=True)


# -- training ---------------------------------------------------------------------------------------


class TranslationModule(LMModule):
    """Label-smoothed cross-entropy on target tokens; at each validation, greedy sacreBLEU too, of
    ``references``: the validation (sources, targets) the data stage read."""

    variable_shapes = True  # token-budget buckets

    def __init__(self, model, recipe, meta: dict, references: tuple[list[str], list[str]]):
        super().__init__(model, recipe, meta)
        self.history.setdefault("bleu", [])  # (step, greedy val BLEU, training wall seconds)
        self.val_metrics: dict[str, float] = {}
        self.references = references

    def logits_and_targets(self, src, src_mask, tgt_in, tgt_mask, tgt_out):
        logits = self.model(src, src_mask, decoder_input_ids=tgt_in, decoder_attention_mask=tgt_mask)
        return logits, tgt_out  # (batch, tgt_len, vocab), (batch, tgt_len)

    def on_validation_epoch_end(self):
        super().on_validation_epoch_end()
        settings = self.recipe.eval
        if self.trainer.sanity_checking or not settings.bleu_at_validation:
            return
        model = whole_model(self)  # every rank: a sharded model is gathered to rank 0
        if not self.trainer.is_global_zero:
            return
        sources, targets = self.references
        tokenizer = tokenizer_of(self.meta)
        hyps = translate(model, tokenizer, sources, 1, 1.0, settings.max_len_a, settings.max_len_b)
        self.val_metrics = {k: v for k, v in score(hyps, targets).items() if k in ("bleu", "chrf")}
        self.history["bleu"].append((self.global_step, self.val_metrics["bleu"], self.wall_seconds()))
        self.log("val_bleu", self.val_metrics["bleu"], prog_bar=True, rank_zero_only=True)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.history.setdefault("bleu", [])


@functools.lru_cache(maxsize=4)
def _tokenizer(proto: bytes):

    return SentencePieceTokenizer(proto)


def tokenizer_of(meta: dict):
    return _tokenizer(meta["tokenizer"]["model_proto"])


def pair_paths(data, recipe_file: Path | None, role: str, split: str | None = None) -> tuple[Path, Path]:
    """The (source, target) files of ``role`` (``train`` or ``validation``): the recipe's own files,
    else the dataset's split for that role (``split`` names another of its splits)."""
    files = getattr(data, role) if split is None else None
    if files is not None:
        return resolve(recipe_file, files.source), resolve(recipe_file, files.target)

    if data.dataset is None:
        raise RecipeError(f"--split {split}: this recipe's data names files, not a dataset")
    found = split_files(data.dataset, split or get(data.dataset).split_of(role), data.dataset_root(recipe_file))
    return found[data.source_lang], found[data.target_lang]


def validation_pairs(located) -> tuple[list[str], list[str]]:
    """The held-out (sources, targets) of a recipe as loaded (its ``eval.max_sentences`` first)."""
    recipe = located.recipe
    return read_pairs(*pair_paths(recipe.data, located.file, "validation"), recipe.eval.max_sentences)


def prepare(run) -> Prepared:
    """The data stage of a translation run: the sentence pairs in token-budget batches and the
    joint tokenizer trained on both sides (or ``model.init_from``'s)."""
    recipe, recipe_file, spec = run.recipe, run.file, run.spec
    data = recipe.data
    train_src, train_tgt = read_pairs(*pair_paths(data, recipe_file, "train"), data.limit_pairs)
    val_src, val_tgt = validation_pairs(run.located)
    text = "\n".join(train_src + train_tgt)
    corpus_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    tokenizer = pretrained_tokenizer(run) or build_tokenizer(
        recipe.tokenizer, text, corpus_hash, Path(data.cache_dir), recipe_file, options={**PROSE, **SPECIALS}
    )
    pad_id, bos, eos = special_ids(tokenizer)
    train, train_lengths = encode_pairs(tokenizer, train_src, train_tgt)
    keep = [i for i, n in enumerate(train_lengths) if n <= data.max_len]
    train, train_lengths = [train[i] for i in keep], train_lengths[keep]
    val, val_lengths = encode_pairs(tokenizer, val_src, val_tgt)
    longest = int(max(train_lengths.max(), val_lengths.max()))
    if longest > spec.max_seq_len:
        raise RecipeError(
            f"pairs of up to {longest} tokens exceed the model's max_seq_len {spec.max_seq_len}; "
            "lower data.max_len or set model.overrides.max_seq_len"
        )
    print(
        f"parallel data: {len(train):,} training pairs ({len(train_src) - len(train):,} longer than "
        f"data.max_len {data.max_len} left out), {len(val):,} validation pairs; joint vocabulary "
        f"{tokenizer.vocab_size:,}",
        flush=True,
    )
    module = BucketDataModule(
        train,
        train_lengths,
        val,
        val_lengths,
        functools.partial(collate, pad_id=pad_id, bos=bos, eos=eos),
        data.max_tokens,
        recipe.trainer.seed,
        recipe.trainer.accumulate_grad_batches,
    )
    settings = recipe.eval

    def callbacks(ckpt_dir: Path):
        return [KeepLastCheckpoints(ckpt_dir, settings.average_last, settings.average_every_n_steps)]

    def module_class(model, recipe, meta):
        return TranslationModule(model, recipe, meta, (val_src, val_tgt))

    def finish(module, model, ckpt_dir: Path) -> dict:
        return final_evaluation(model, tokenizer, ckpt_dir / "averaged.ckpt", val_src, val_tgt, settings)

    return Prepared(
        tokenizer=tokenizer,
        data=module,
        module_class=module_class,
        tokens_of=tokens_of,
        seq_len=int(np.median(train_lengths)),
        batch=1,
        meta={"corpus": corpus_hash},
        callbacks=callbacks,
        finish=finish,
    )


def final_evaluation(model, tokenizer, averaged: Path, sources, references, settings) -> dict:
    """Beam search on the validation set with the averaged weights (the trained ones without)."""
    if averaged.is_file():
        state = read_verified(averaged)["state_dict"]
        model.load_state_dict(model_weights(state))
    what = f"validation, beam {settings.num_beams}, {'averaged ' + averaged.name if averaged.is_file() else 'last'}"
    hyps = translate(
        model, tokenizer, sources, settings.num_beams, settings.length_penalty, settings.max_len_a, settings.max_len_b
    )
    result = score(hyps, references)
    print_scores(result, what)
    return {"final": {k: result[k] for k in ("bleu", "chrf", "bleu_signature", "chrf_signature")}}


# -- builder eval / builder generate ---------------------------------------------------------------


def evaluate(model, tokenizer, data_section, meta: dict, args) -> dict:
    """Score ``--src`` against ``--ref`` (default: the recipe's validation files);
    ``data_section``: the schema of the recipe's data section (validated here, when read)."""
    if (args.src is None) != (args.ref is None):
        raise RecipeError("give --src and --ref together (or neither: the recipe's validation pair)")
    recipe = meta["recipe"]
    if args.src is None:
        data = data_section.model_validate(recipe["data"])
        src_path, ref_path = pair_paths(data, Path(meta["recipe_file"]), "validation", getattr(args, "split", None))
    else:
        src_path, ref_path = Path(args.src), Path(args.ref)
    sources, references = read_pairs(src_path, ref_path, args.max_sentences)
    settings = recipe["eval"]
    beams = args.num_beams or settings["num_beams"]
    lp = args.length_penalty if args.length_penalty is not None else settings["length_penalty"]
    hyps = translate(model, tokenizer, sources, beams, lp, settings["max_len_a"], settings["max_len_b"], progress=True)
    if args.output:
        Path(args.output).write_text("\n".join(hyps) + "\n", encoding="utf-8")
    result = score(hyps, references)
    return {
        "src": str(src_path),
        "ref": str(ref_path),
        "sentences": len(sources),
        "num_beams": beams,
        "length_penalty": lp,
        **result,
    }


def generate(model, tokenizer, meta: dict, args) -> str:
    settings = meta["recipe"]["eval"]
    beams = args.num_beams if args.num_beams > 1 else settings["num_beams"]
    return translate(
        model, tokenizer, [args.prompt], beams, settings["length_penalty"], settings["max_len_a"], settings["max_len_b"]
    )[0]
