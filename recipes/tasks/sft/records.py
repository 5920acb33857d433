"""``task: sft``'s records, torch-free: the files they are in, the tokenizer they are encoded
with, and :func:`check_records`, the dry run's (and ``builder validate``'s) reading of them with
the run's own code, so that both refuse a record in the same line."""

from __future__ import annotations

import hashlib
from pathlib import Path

from yamlformer.recipes.data.chat import ChatFormat, conversation
from yamlformer.recipes.data.records import encode_file, read_records, shuffled
from yamlformer.recipes.data.registry import get
from yamlformer.recipes.errors import RecipeError
from yamlformer.recipes.fields import resolve


def record_files(data, recipe_file: Path | None) -> tuple[Path, Path | None]:
    """``(training records, held-out records or None)``: ``data.file`` (and ``data.validation``),
    or the files a dataset by name is made of (its first: the records)."""
    if data.file is not None:
        held = resolve(recipe_file, data.validation) if data.validation else None
        return resolve(recipe_file, data.file), held
    dataset = get(data.dataset)
    if dataset.local is None:
        raise RecipeError(f"data.dataset: {data.dataset} is not a dataset of records; give data.file")
    return dataset.local()[0], resolve(recipe_file, data.validation) if data.validation else None


def one_conversation(record) -> list[list[dict]]:
    """An sft record's conversations: the one it is (:func:`~yamlformer.recipes.data.chat.conversation`)."""
    return [conversation(record)]


def tokenizer_for(located, train: Path, conversations=one_conversation, pretrained=None):
    """``pretrained`` (``model.init_from``'s tokenizer, :func:`~yamlformer.recipes.trained.pretrained_tokenizer`
    of the run) when there is one, else the recipe's: a char table of the records' text as the chat
    template renders it (its framing's characters too, which a table of the contents alone could
    not encode), a sentencepiece model trained on the messages' contents when it names no file.
    ``located``: the recipe as loaded (or the ``Run``); ``conversations``: a record's conversations
    (an sft record's one, a pair's two sides)."""
    # local: the tokenizer libraries (sentencepiece, Hugging Face's) load when a run reads its data
    from yamlformer.recipes.data.tokenizers import CharTokenizer, build_tokenizer

    if pretrained is not None:
        return pretrained
    recipe, recipe_file = located.recipe, located.file
    char = recipe.tokenizer.type == "char"
    chat = ChatFormat(CharTokenizer.fit("", eos=True), recipe.data.chat_template) if char else None
    texts = []
    for where, record in read_records(train):
        try:
            sides = conversations(record)
            if char:
                texts += [chat.text(side) for side in sides]
            else:  # each message once: a pair's sides share their prompt's
                texts += [m["content"] for m in {id(m): m for side in sides for m in side}.values()]
        except ValueError as exc:
            raise RecipeError(f"{where}: {exc}") from None
    text = "\n".join(texts)
    cache = Path(recipe.data.cache_dir)
    return build_tokenizer(recipe.tokenizer, text, hashlib.sha256(text.encode()).hexdigest()[:16], cache, recipe_file)


def split(records: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """``(training, held-out)``: ``val_fraction`` of the records (at least one), chosen by the seed."""
    if len(records) < 2:
        raise RecipeError("data: fewer than 2 records; give more, or a data.validation file")
    order = shuffled(len(records), seed, 0)
    held = max(1, round(len(records) * val_fraction))
    return [records[i] for i in sorted(order[held:])], [records[i] for i in sorted(order[:held])]


#: how many records of each file the dry run encodes, as the run encodes them (every record is
#: read and parsed): a file's first records show a failing template or a record too long, and a
#: dry run of a file of millions of records stays a check, not the run's work
DRY_RUN_RECORDS = 1_000


def check_records(located, pretrained=None) -> None:
    """Refuse (:class:`RecipeError`, the run's own line) the records a run of ``located`` would
    refuse at once, with the run's code: every record read and made a conversation, the first
    :data:`DRY_RUN_RECORDS` of each file (at most ``data.limit``) rendered with the chat template
    and encoded with the run's tokenizer (``pretrained``: the tokenizer state of ``model.init_from``),
    no file without records, at least 2 records without a held-out file. Nothing is written: a
    sentencepiece tokenizer the run would train is stood in for by the records' char table, and
    then no record is refused for its length (a char has fewer tokens to it than a piece)."""
    # local: the tokenizer libraries (sentencepiece, Hugging Face's) load when the records are read
    from yamlformer.recipes.data.tokenizers import from_state

    recipe = located.recipe
    data, settings = recipe.data, recipe.tokenizer
    train, held = record_files(data, located.file)
    if not train.is_file():
        return  # a named dataset not downloaded yet: the run fetches it, then reads it
    seq_len = data.seq_len
    if pretrained is not None:
        try:
            tokenizer = from_state(pretrained)
        except Exception:  # the run names the checkpoint in its own line (trained.checkpoint_tokenizer)
            return
    elif settings.type == "sentencepiece" and settings.model_file is None:
        char = recipe.model_copy(update={"tokenizer": settings.model_copy(update={"type": "char"})})
        tokenizer = tokenizer_for(located.with_recipe(char), train)
        seq_len = 1 << 62
    else:
        tokenizer = tokenizer_for(located, train)
    chat = ChatFormat(tokenizer, data.chat_template)
    first = min(data.limit or DRY_RUN_RECORDS, DRY_RUN_RECORDS)
    encoded = encode_file(train, chat, seq_len, first)
    if held is not None:
        encode_file(held, chat, seq_len, DRY_RUN_RECORDS)
    elif len(encoded) < 2:
        split(encoded, data.val_fraction, recipe.trainer.seed)
