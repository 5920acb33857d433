"""Instruction and chat data (``task: sft``): records rendered with the tokenizer's chat template
(through ``transformers``) or the plain default, the loss on the answers only, records packed with
document masking, resumable order, and each bad record one line naming its file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from yamlformer.recipes.data.chat import DEFAULT_TEMPLATE, ChatFormat, conversation
from yamlformer.recipes.data.instructions import IGNORE, Rows, TrainRows, encode_file
from yamlformer.recipes.data.tokenizers import CharTokenizer, HFTokenizer
from yamlformer.recipes.errors import RecipeError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "and three"},
    {"role": "assistant", "content": "seven"},
]


def _chatml_tokenizer() -> HFTokenizer:
    """A word-level Hugging Face tokenizer with ChatML's special tokens and template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "be", "brief", "two", "plus", "four", "and", "three", "seven", "system", "user", "assistant"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    specials = {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
    return HFTokenizer(tokenizer.to_str(), specials, chat_template=CHATML)


def test_a_chat_template_trains_on_each_answer_and_its_end_of_turn():
    tokenizer = _chatml_tokenizer()
    chat = ChatFormat(tokenizer)
    assert chat.source == "tokenizer" and chat.eos is None  # the template ends its turns itself
    pieces = chat.pieces(CHAT)
    assert [text for text, trained in pieces if trained] == ["four<|im_end|>\n", "seven<|im_end|>\n"]
    assert "".join(text for text, _ in pieces) == tokenizer_render(tokenizer, CHAT)
    encoded = chat.encode(CHAT)
    trained = [tokenizer.decode([i]) for i, t in zip(encoded.ids, encoded.trained) if t]
    assert trained == ["four", "", "seven", ""]  # the end-of-turn tokens (special: decoded empty) train too
    end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert [int(i) for i, t in zip(encoded.ids, encoded.trained) if t].count(end) == 2
    # the prompt for the last answer is training's context for it, token for token
    assert chat.prompt(CHAT) == encoded.ids[: encoded.starts[-1]].tolist()


def tokenizer_render(tokenizer, messages) -> str:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer, chat_template=CHATML)
    return hf.apply_chat_template(messages, tokenize=False)


def test_without_a_template_the_default_one_ends_each_answer_with_eos():
    tokenizer = CharTokenizer.fit("abcdefghijklmnopqrstuvwxyz #:\n.?IRsponetuci", eos=True)
    chat = ChatFormat(tokenizer)
    assert chat.template == DEFAULT_TEMPLATE and chat.source == "default"
    record = conversation({"prompt": "add one to two?", "response": "three."})
    encoded = chat.encode(record)
    answer = tokenizer.decode([i for i, t in zip(encoded.ids, encoded.trained) if t])
    assert answer.startswith("three.") and encoded.ids[-1] == tokenizer.eos_id and encoded.trained[-1]
    context = tokenizer.decode(encoded.ids[: encoded.starts[0]].tolist())
    assert context == "### Instruction:\nadd one to two?\n\n### Response:\n"
    assert chat.prompt(record) == encoded.ids[: encoded.starts[0]].tolist()


def test_records_pack_whole_with_document_masking_and_loss_on_answers():
    tokenizer = CharTokenizer.fit("abcdefghijklmnopqrstuvwxyz #:\n.?IRsponetuci", eos=True)
    chat = ChatFormat(tokenizer)
    records = [chat.encode(conversation({"prompt": "q" * n, "response": "a" * n})) for n in (1, 5, 2, 9, 3)]
    width = 96
    rows = Rows(records, width, pad=0, packing=True)
    assert sum(len(r) for r in records) == rows.tokens and len(rows) < len(records)
    inputs, targets, documents = rows.batch(np.arange(len(rows)))
    for r in range(len(rows)):
        docs = documents[r]
        assert bool((docs[1:] >= docs[:-1]).all())  # non-decreasing: what the model's masking takes
        kept = targets[r] != IGNORE
        # a target only inside a record, where the next token is an answer's
        same = torch.cat([docs[1:] == docs[:-1], documents.new_tensor([True])])
        assert bool((~kept | same).all())
    answers = sum(int(r.trained[1:].sum()) for r in records)  # a record's first token is never an answer
    assert int((targets != IGNORE).sum()) == answers
    assert sorted(i for row in rows.records for i in row) == list(range(len(records)))  # each record once
    one_each = Rows(records, width, pad=0, packing=False)
    assert len(one_each) == len(records) and one_each.records == [[i] for i in range(len(records))]


def test_records_fill_the_first_row_with_room_for_them():
    import random

    from yamlformer.recipes.data.instructions import pack

    assert pack([5, 8, 3, 2], 10) == [[0, 2, 3], [1]]  # 3 and 2 fill the first row's gap
    assert pack([5, 8, 3, 2], 10, window=1) == [[0], [1], [2, 3]]  # the newest row only: next fit
    generator = random.Random(0)
    lengths = [generator.randint(32, 160) + generator.randint(16, 96) for _ in range(5000)]
    fill = {w: sum(lengths) / (len(pack(lengths, 257, window=w)) * 257) for w in (1, 64)}
    assert fill[64] > 0.83 and fill[1] < 0.72, fill  # the module doc's 85% against 70%
    for row in pack(lengths, 257):
        assert sum(lengths[i] for i in row) <= 257 and row == sorted(row)


def test_training_rows_resume_where_they_stopped():
    tokenizer = CharTokenizer.fit("abcdefghijklmnopqrstuvwxyz #:\n.?IRsponetuci", eos=True)
    chat = ChatFormat(tokenizer)
    records = [chat.encode(conversation({"prompt": "q" * n, "response": "a"})) for n in range(1, 12)]
    rows = Rows(records, 48, pad=0, packing=True)
    whole = iter(TrainRows(rows, 3, rank=0, world=1, position=0, seed=7))
    batches = [next(whole) for _ in range(9)]  # three passes over the rows and more
    resumed = iter(TrainRows(rows, 3, rank=0, world=1, position=5, seed=7))
    for expected in batches[5:]:
        for a, b in zip(next(resumed), expected):
            assert torch.equal(a, b)
    # two ranks take, between them, the rows one rank takes in a step of twice the batch
    ranks = [iter(TrainRows(rows, 3, rank=r, world=2, position=0, seed=7)) for r in (0, 1)]
    first = [next(r)[0] for r in ranks]
    single = next(iter(TrainRows(rows, 6, rank=0, world=1, position=0, seed=7)))[0]
    assert torch.equal(torch.cat(first), single)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ('["a list"]', "a JSON array, not a record"),
        ('{"prompt": "x"}', "no string response and no messages"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0] has no role"),
        ('{"prompt": "x", "response": "' + "y" * 80 + '"}', "more than data.seq_len 64"),
    ],
)
def test_a_bad_record_is_one_line_naming_its_file_and_line(line, message, tmp_path):
    tokenizer = CharTokenizer.fit("abcdefghijklmnopqrstuvwxyz #:\n.?IRsponetuci", eos=True)
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "response": "yes"}) + "\n\n" + line + "\n")
    with pytest.raises(RecipeError) as caught:
        encode_file(path, ChatFormat(tokenizer), seq_len=64)
    text = str(caught.value)
    assert text.startswith(f"{path}:3: ") and message in text and "\n" not in text
    assert "y" * 20 not in text  # the record itself is never printed


def test_parquet_records_name_their_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = CharTokenizer.fit("abcdefghijklmnopqrstuvwxyz #:\n.?IRsponetuci", eos=True)
    path = tmp_path / "records.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["c", None]}), path)
    with pytest.raises(RecipeError, match=r"records.parquet: row 1: no string response"):
        encode_file(path, ChatFormat(tokenizer), seq_len=64)
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["c", "d"]}), path)
    assert len(encode_file(path, ChatFormat(tokenizer), seq_len=64)) == 2
