"""Preference pairs for ``task: preference``: records read as instruction records are
(:func:`yamlformer.recipes.data.instructions.read_records`), rendered with the chat template
(:mod:`yamlformer.recipes.data.chat`), packed into rows with document masking.

A record is ``{"prompt": str, "chosen": str, "rejected": str}`` (and ``"system"``), or
conversational: ``"prompt"`` a list of messages and ``"chosen"``/``"rejected"`` lists of the
assistant messages that follow it, or without ``"prompt"`` ``"chosen"``/``"rejected"`` two whole
conversations that share everything before their last assistant message (that shared part is the
prompt). Each side is encoded as the prompt followed by its answer; its targets are the answer's
tokens only (what the chat template adds for the answer, and the EOS the plain default template
ends it with), so a chosen and a rejected response are scored over their own tokens, never the
prompt's.

Rows: a pair is one unit, its chosen then its rejected sequence, two documents (the model masks
attention between them and restarts positions). ``packing: true`` puts pairs first fit into rows of
``seq_len + 1`` tokens (:func:`yamlformer.recipes.data.instructions.pack`); ``false``: one pair a
row. A micro-batch is whole pairs, so its rows hold both sides of each of its pairs. A record that
is not a pair, or a pair longer than the row (``seq_len + 1`` tokens for the two together), stops
the run in one line naming its file and line, never quoting it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from yamlformer.recipes.data.chat import ROLES, ChatError, ChatFormat, Encoded
from yamlformer.recipes.data.instructions import pack, read_records
from yamlformer.recipes.data.sources import _json_kind
from yamlformer.recipes.data.windows import IGNORE
from yamlformer.recipes.errors import RecipeError

SIDES = ("chosen", "rejected")


def _messages(value, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ChatError(f"{field} is neither a string nor a list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ChatError(f"{field}[{i}] has no role of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ChatError(f"{field}[{i}].content is not a string")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def pair_conversations(record) -> tuple[list[dict], list[dict], list[dict]]:
    """``(prompt, chosen answer, rejected answer)`` messages of one record (module doc);
    :class:`ChatError` saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ChatError(f"a {type(record).__name__}, not an object with prompt, chosen and rejected")
    missing = [side for side in SIDES if side not in record]
    if missing:
        names = ", ".join(repr(str(k)[:40]) for k in list(record)[:10]) or "none"
        raise ChatError(f"no {' or '.join(missing)} (its fields: {names})")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if isinstance(chosen, str) or isinstance(rejected, str):
        for side, answer in zip(SIDES, (chosen, rejected)):
            if not isinstance(answer, str):
                raise ChatError(f"{side} is not a string, as the other answer is")
        if not isinstance(prompt, str):
            raise ChatError("chosen and rejected are strings, so prompt must be one too")
        system = record.get("system")
        if system is not None and not isinstance(system, str):
            raise ChatError("system is not a string")
        head = [{"role": "system", "content": system}] if system else []
        context = [*head, {"role": "user", "content": prompt}]
        return context, [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
    chosen, rejected = _messages(chosen, "chosen"), _messages(rejected, "rejected")
    if prompt is not None:
        context = _messages(prompt, "prompt")
    else:  # two whole conversations: the shared part before the last assistant message is the prompt
        last = max((i for i, m in enumerate(chosen) if m["role"] == "assistant"), default=None)
        if last is None or chosen[:last] != rejected[:last] or len(rejected) <= last:
            raise ChatError("chosen and rejected do not share a prompt before their last assistant message")
        context, chosen, rejected = chosen[:last], chosen[last:], rejected[last:]
    for side, answer in zip(SIDES, (chosen, rejected)):
        if not any(m["role"] == "assistant" for m in answer):
            raise ChatError(f"{side} has no assistant message: nothing to compare")
    if not context:
        raise ChatError("the prompt has no message")
    return context, chosen, rejected


def pair_sides(record) -> list[list[dict]]:
    """The two conversations of a pair (its prompt then each answer), sharing the prompt's messages."""
    context, chosen, rejected = pair_conversations(record)
    return [[*context, *chosen], [*context, *rejected]]


@dataclasses.dataclass
class EncodedPair:
    """A pair's two sequences (prompt then answer each), their targets the answer's tokens only."""

    chosen: Encoded
    rejected: Encoded

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


def encode_pair(chat: ChatFormat, record) -> EncodedPair:
    """One record encoded (module doc); :class:`ChatError` when it is no pair."""
    context, chosen, rejected = pair_conversations(record)
    answered = sum(m["role"] == "assistant" for m in context)  # the prompt's own answers are context
    sides = []
    for answer in (chosen, rejected):
        encoded = chat.encode([*context, *answer])
        trained = encoded.trained.copy()
        if answered:
            trained[: encoded.starts[answered]] = False
        if not trained.any():
            raise ChatError("an answer encodes to no token: nothing to compare")
        sides.append(Encoded(encoded.ids, trained, encoded.starts[answered:]))
    return EncodedPair(*sides)


def encode_pairs(path: Path, chat: ChatFormat, seq_len: int, limit: int | None = None) -> list[EncodedPair]:
    """Every record of ``path`` encoded (the first ``limit``); a record that is no pair, or whose
    two sequences together are longer than a row of ``seq_len + 1`` tokens, is a
    :class:`RecipeError` naming its file and line."""
    out = []
    for where, record in read_records(path):
        if limit is not None and len(out) >= limit:
            break
        try:
            pair = encode_pair(chat, record)
        except ChatError as exc:
            kind = _json_kind(record) if not isinstance(record, dict) else None
            raise RecipeError(f"{where}: {exc if kind is None else f'a JSON {kind}, not a preference pair'}") from None
        if len(pair) > seq_len + 1:
            raise RecipeError(
                f"{where}: the pair is {len(pair.chosen):,} + {len(pair.rejected):,} tokens as rendered "
                f"({chat.describe()}), more than a row of data.seq_len + 1 = {seq_len + 1:,} holds; raise "
                "data.seq_len or shorten the record"
            )
        out.append(pair)
    if not out:
        raise RecipeError(f"{path}: no records")
    return out


class PairRows:
    """Pairs packed into rows of ``seq_len + 1`` tokens (module doc): ``ids``, ``trained`` and
    ``documents`` ``(rows, seq_len + 1)`` as :class:`yamlformer.recipes.data.instructions.Rows`
    has them, and ``sequence``: each token's sequence, ``2 x pair + side`` (side 0 chosen, 1
    rejected; -1 padding); ``records``: the pairs of each row."""

    def __init__(self, pairs: list[EncodedPair], seq_len: int, pad: int, packing: bool):
        width = seq_len + 1
        self.records = pack([len(p) for p in pairs], width) if packing else [[i] for i in range(len(pairs))]
        self.ids = np.full((len(self.records), width), pad, dtype=np.int64)
        self.trained = np.zeros((len(self.records), width), dtype=bool)
        self.documents = np.zeros((len(self.records), width), dtype=np.int64)
        self.sequence = np.full((len(self.records), width), -1, dtype=np.int64)
        for r, row in enumerate(self.records):
            at, document = 0, 0
            for i in row:
                for side, encoded in enumerate((pairs[i].chosen, pairs[i].rejected)):
                    end = at + len(encoded)
                    self.ids[r, at:end], self.trained[r, at:end] = encoded.ids, encoded.trained
                    self.documents[r, at:end], self.sequence[r, at:end] = document, 2 * i + side
                    at, document = end, document + 1
            self.documents[r, at:] = document  # the padding: a document of its own
        self.pairs = len(pairs)
        self.tokens = sum(len(p) for p in pairs)
        #: ``(pairs, 2)`` float32: each pair's reference log-probabilities (chosen, rejected) when
        #: they were precomputed (``preference.precompute_reference``), else None
        self.reference: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, index: np.ndarray) -> tuple:
        """``(inputs, targets, document_ids, sequences, pairs, reference)`` of rows ``index``: a
        target where the next token is an answer's and of the same sequence, else ``IGNORE``;
        ``sequences`` each target's sequence renumbered ``2 x j + side`` over the batch's ``pairs``
        pairs (an int), -1 where there is no target; ``reference``: the pairs' precomputed reference
        log-probabilities ``(pairs, 2)`` in that order, or None."""
        ids, trained, documents = (torch.from_numpy(a[index]) for a in (self.ids, self.trained, self.documents))
        sequence = self.sequence[index][:, 1:]
        keep = trained[:, 1:] & (documents[:, 1:] == documents[:, :-1])
        targets = ids[:, 1:].masked_fill(~keep, IGNORE)
        order = [i for r in index.tolist() for i in self.records[r]]  # the batch's pairs, row by row
        local = np.full(2 * self.pairs, -1, dtype=np.int64)
        local[0::2][order] = 2 * np.arange(len(order))
        local[1::2][order] = 2 * np.arange(len(order)) + 1
        sequences = torch.from_numpy(np.where(sequence >= 0, local[sequence], -1)).masked_fill(~keep, -1)
        reference = None if self.reference is None else torch.from_numpy(self.reference[order])
        return ids[:, :-1].contiguous(), targets, documents[:, :-1].contiguous(), sequences, len(order), reference
