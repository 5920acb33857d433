"""``task: sft``'s training side: the records, tokenizer and spec of a run and its packed rows
(:func:`prepare`); the held-out prompts scored before the first step and after the last
(:class:`HeldOut`); ``builder eval`` and ``builder generate`` on its checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F

from yamlformer.recipes.data.chat import ChatFormat, conversation
from yamlformer.recipes.data.instructions import IGNORE, InstructionData, Rows, encode_file, read_records, shuffled
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.learning.module import LMModule
from yamlformer.recipes.parallel.compile import eager
from yamlformer.recipes.parallel.fsdp import is_sharded_model
from yamlformer.recipes.say import say
from yamlformer.recipes.tasks import task_named
from yamlformer.recipes.tasks.sft.records import record_files, split, tokenizer_for
from yamlformer.recipes.tasks.task import Prepared
from yamlformer.recipes.trained import pretrained_tokenizer


class Records:
    """A run's records: encoded (training and held-out), the held-out conversations (for their
    prompts and reference answers) and the chat format they were rendered with."""

    def __init__(self, data, recipe_file: Path | None, tokenizer, seed: int):
        train_path, held_path = record_files(data, recipe_file)
        self.chat = ChatFormat(tokenizer, data.chat_template)
        conversations = [conversation(r) for _, r in read_records(train_path)][: data.limit]
        train = encode_file(train_path, self.chat, data.seq_len, data.limit)
        if held_path is not None:
            held_conversations = [conversation(r) for _, r in read_records(held_path)]
            held = encode_file(held_path, self.chat, data.seq_len)
        else:
            pairs = list(zip(train, conversations))
            train_pairs, held_pairs = split(pairs, data.val_fraction, seed)
            train = [e for e, _ in train_pairs]
            held, held_conversations = [e for e, _ in held_pairs], [c for _, c in held_pairs]
        pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        order = shuffled(len(train), seed, 1)  # packed in a seeded order: a row mixes the file's records
        self.train = Rows([train[i] for i in order], data.seq_len, pad, data.packing)
        self.held = Rows(held, data.seq_len, pad, data.packing)
        self.held_conversations = held_conversations
        self.line = (
            f"records: {len(train):,} training in {len(self.train):,} rows of {data.seq_len} tokens "
            f"({self.train.tokens / (len(self.train) * (data.seq_len + 1)):.0%} filled), {len(held):,} held out; "
            f"{self.chat.describe()}"
        )


class InstructionModule(LMModule):
    """Next-token loss on the answers only (``LMModule`` as it is; the head projects only those)."""

    scores_only_targets = True


def prepare(run) -> Prepared:
    """Records -> tokenizer -> packed rows (the spec is the run's, checked by the task before);
    the held-out prompts scored before and after."""
    recipe, recipe_file = run.recipe, run.file
    data, settings = recipe.data, recipe.trainer
    train_path, _ = record_files(data, recipe_file)
    tokenizer = tokenizer_for(run, train_path, pretrained=pretrained_tokenizer(run))
    records = Records(data, recipe_file, tokenizer, settings.seed)
    say(records.line)
    module = InstructionData(
        records.train,
        records.held,
        data.batch_size,
        settings.seed,
        settings.limit_val_batches,
        settings.accumulate_grad_batches,
    )
    held_out = HeldOut(records, tokenizer, recipe.eval)

    def finish(lightning_module, model, ckpt_dir: Path) -> dict:
        return held_out.after(model)

    return Prepared(
        tokenizer=tokenizer,
        data=module,
        module_class=InstructionModule,
        seq_len=data.seq_len,
        batch=data.batch_size,
        meta={"records": records.train.tokens},
        callbacks=lambda ckpt_dir: [held_out],
        finish=finish,
    )


@torch.no_grad()
def held_out_scores(model, records: Records, tokenizer, settings, batch: int, batches: int | None = None) -> dict:
    """The answers' loss over the held-out rows (the first ``batches`` batches of ``batch`` rows;
    None: all) and, for the first ``settings.prompts`` held-out records, whether the greedy answer
    to their prompt is their reference answer (both stripped)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = len(records.held) if batches is None else min(len(records.held), batches * batch)
    with eager():
        total, count = 0.0, 0
        for first in range(0, rows, batch):
            inputs, targets, documents = records.held.batch(np.arange(first, min(first + batch, rows)))
            logits = model(inputs.to(device), document_ids=documents.to(device))
            total += F.cross_entropy(
                logits.flatten(0, 1).float(), targets.to(device).flatten(), reduction="sum", ignore_index=IGNORE
            ).item()
            count += int((targets != IGNORE).sum())
        exact, answers = 0, []
        for messages in records.held_conversations[: settings.prompts]:
            answer = generated_answer(model, records.chat, tokenizer, messages, settings.max_new_tokens)
            reference = next(m["content"] for m in reversed(messages) if m["role"] == "assistant")
            exact += answer.strip() == reference.strip()
            answers.append(answer)
    model.train(was_training)
    return {"loss": total / max(count, 1), "tokens": count, "exact": exact, "prompts": len(answers), "answers": answers}


def generated_answer(model, chat: ChatFormat, tokenizer, messages, max_new_tokens: int, **sampling) -> str:
    """The model's answer to the last user turn of ``messages`` (greedy unless ``sampling``)."""
    device = next(model.parameters()).device
    prompt = chat.prompt(messages)
    room = model.spec.max_seq_len - len(prompt)
    if room < 1:
        raise RecipeError(f"the prompt is {len(prompt):,} tokens, the model's max_seq_len {model.spec.max_seq_len:,}")
    out = model.generate(
        torch.tensor([prompt], device=device),
        min(max_new_tokens, room),
        eos_token_id=tokenizer.eos_id,
        vocab_size=tokenizer.vocab_size,  # never an embedding padding row: it would not decode
        **sampling,
    )
    new = out[0, len(prompt) :].tolist()
    if tokenizer.eos_id is not None and tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    return tokenizer.decode(new)


class BeforeAndAfter(L.Callback):
    """Held-out scores as a run starts (``before``) and as it ends; the first rides in
    checkpoints, so a resumed run still reports both."""

    before: dict | None = None

    def reported(self, after: dict, compared, line) -> dict:
        """Say ``compared(before, after)``, or ``line(after)`` without a first score (a sharded run's);
        the scores as a run's final metrics."""
        say(compared(self.before, after) if self.before is not None else f"held out, after training: {line(after)}")
        return {"held_out": {"before": self.before, "after": after}}

    def state_dict(self) -> dict:
        return {"before": self.before}

    def load_state_dict(self, state: dict) -> None:
        self.before = state.get("before")


class HeldOut(BeforeAndAfter):
    """The held-out records scored with the model as a run starts (the base: adapters start as
    the identity) and as it ends (:meth:`after`)."""

    def __init__(self, records: Records, tokenizer, settings):
        self.records, self.tokenizer, self.settings = records, tokenizer, settings

    def _scores(self, model) -> dict:
        return held_out_scores(model, self.records, self.tokenizer, self.settings, batch=8)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.before is not None or trainer.global_step:
            return
        model = pl_module.model
        if is_sharded_model(model) or getattr(pl_module, "pipeline", None) is not None:
            return  # a sharded model is scored whole at the end only
        self.before = self._scores(model)
        if trainer.is_global_zero:
            say(f"held out, before training: {_line(self.before)}")

    def after(self, model) -> dict:
        after = self._scores(model)
        result = self.reported(after, _compared, _line)
        for messages, answer in list(zip(self.records.held_conversations, after["answers"]))[:3]:
            prompt = next(m["content"] for m in reversed(messages) if m["role"] == "user")
            say(f"  {prompt[:80]!r} -> {answer.strip()[:80]!r}")
        return result


def _compared(before: dict, after: dict) -> str:
    return (
        f"held out: answers' loss {before['loss']:.4f} -> {after['loss']:.4f}; exact match "
        f"{before['exact']}/{before['prompts']} -> {after['exact']}/{after['prompts']}"
    )


def _line(scores: dict) -> str:
    loss, exact = f"{scores['loss']:.4f} ({scores['tokens']:,} tokens)", f"{scores['exact']}/{scores['prompts']}"
    return f"answers' loss {loss}, exact match {exact}"


# -- builder eval and builder generate --------------------------------------------------------------


def checkpoint_recipe(meta: dict):
    """The recipe a checkpoint was trained with (its task's: sft's or one that reads its records
    alike; its paths absolute, as checkpoints keep them)."""
    recipe_cls = task_named(meta.get("task", "sft")).recipe
    if not isinstance(meta.get("recipe"), dict):
        raise RecipeError("the checkpoint holds no training recipe (its records and chat template)")
    return recipe_cls.model_validate({k: v for k, v in meta["recipe"].items() if k in recipe_cls.model_fields})


def evaluate_checkpoint(model, tokenizer, meta: dict, args) -> dict:
    """``builder eval`` on an sft checkpoint: the answers' loss over its run's held-out rows
    (``--max-batches``, else the recipe's ``limit_val_batches``; ``--all``) and the exact matches
    of its held-out prompts (the recipe's ``eval``)."""
    recipe = checkpoint_recipe(meta)
    records = Records(recipe.data, Path(meta["recipe_file"]), tokenizer, recipe.trainer.seed)
    batch = args.batch_size or recipe.data.batch_size
    available = math.ceil(len(records.held) / batch)
    batches = available if args.all else min(available, args.max_batches or recipe.trainer.limit_val_batches)
    scores = held_out_scores(model, records, tokenizer, recipe.eval, batch, batches)
    scores.pop("answers")
    return {**scores, "batches": batches, "batches_available": available}


def generate(model, tokenizer, meta: dict, args) -> None:
    """``builder generate`` on an sft (or preference) checkpoint: the answer to ``--prompt`` as a user turn, in
    the chat template the run trained with."""
    chat = ChatFormat(tokenizer, checkpoint_recipe(meta).data.chat_template)
    sampling = {}
    if args.temperature:
        sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    if args.seed is not None:
        sampling["generator"] = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
    print(
        generated_answer(
            model, chat, tokenizer, [{"role": "user", "content": args.prompt}], args.max_new_tokens, **sampling
        )
    )
