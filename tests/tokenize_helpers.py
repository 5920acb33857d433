"""What the tokenizer tests share: a small vocabulary's random documents and a sentencepiece
model trained on them (tests/test_tokenize.py, tests/test_tokenized_integrity.py)."""

from __future__ import annotations

import random

import pytest

from yamlformer.recipes.recipe.sections import TokenizerSection

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "had",
    "been",
    "one",
    "all",
    "we",
    "can",
    "their",
    "has",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "über",
    "naïve",
    "café",
]


def docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 120))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), ".\n")
        out.append(" ".join(words))
    return out


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    """A small sentencepiece model with an EOS piece, as train_sentencepiece now trains them."""
    from yamlformer.recipes.data.tokenizers import SentencePieceTokenizer, train_sentencepiece

    proto = train_sentencepiece("\n".join(docs(800, seed=9)), TokenizerSection(vocab_size=300))
    path = tmp_path_factory.mktemp("sp") / "sp.model"
    path.write_bytes(proto)
    return SentencePieceTokenizer(proto), path
