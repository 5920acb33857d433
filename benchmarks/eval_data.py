"""What `builder eval` spends on its data before the first batch: the text of `--data` files read
and tokenized on every eval (before) against read from its token cache (after), and a recipe's
validation text found in its tokenized cache by the files' sizes and times, against read and
hashed first.

    python benchmarks/eval_data.py                       # 200 files of 20 kB, sentencepiece 400
    python benchmarks/eval_data.py --files 50 --repeats 3

Each measurement is the median of ``--repeats`` alternating rounds in this process (imports
done before the clock starts), so the ratios compare runs on the same machine at the same time:

* ``data_reread_s``: what every `builder eval --data` did before: read the files, encode each
  document (plus EOS) in memory;
* ``data_first_s``: the first eval now: the same, written to the cache as a tokenized dataset;
* ``data_cached_s``: every later eval: the files listed and stat'ed, the tokens read from the cache;
* ``recipe_hashed_s`` / ``recipe_indexed_s``: a recipe's text sources opened against their
  tokenized cache, the text read and hashed (no text index: what an eval did, twice) or found by
  its index.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from machine import emit, machine  # noqa: E402

from yamlformer.recipes.data.corpus import open_corpus, read_text  # noqa: E402
from yamlformer.recipes.data.tokenizers import SentencePieceTokenizer, train_sentencepiece  # noqa: E402
from yamlformer.recipes.recipe.sections import DataSection, TokenizerSection  # noqa: E402
from yamlformer.recipes.tasks.lm.training import file_tokens  # noqa: E402

#: the words of the made-up corpus, and their number
WORDS = [
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
    "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you",
    "were", "her", "she", "there", "had", "been", "one", "all", "we", "can", "their", "has", "more", "when",
]  # fmt: skip


def corpus(folder: Path, files: int, kilobytes: int, seed: int = 0) -> list[str]:
    """``files`` text files of ``kilobytes`` each, of words and pairs of them glued (a subword
    tokenizer has work to do)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    texts = []
    for i in range(files):
        words, size = [], 0
        while size < kilobytes * 1000:
            word = rng.choice(WORDS) + (rng.choice(WORDS) if rng.random() < 0.3 else "")
            word += "\n" if rng.random() < 0.1 else " "
            words.append(word)
            size += len(word)
        texts.append("".join(words))
        (folder / f"doc{i:04d}.txt").write_text(texts[-1])
    return texts


#: the measurements of the --data path
DATA = ("reread", "first", "cached")


def reread(folder: Path, tokenizer) -> int:
    """The old `--data` path: every file read, every document encoded, each eval."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(folder.iterdir())]
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    return len([i for text in texts for i in tokenizer.encode(text) + eos])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--kb", type=int, default=20, help="kilobytes of text per file")
    parser.add_argument("--vocab", type=int, default=400, help="the sentencepiece tokenizer's vocabulary")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    print(f"machine: {machine()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="eval-data-"))
    try:
        texts = corpus(work / "data", args.files, args.kb)
        tokenizer = SentencePieceTokenizer(
            train_sentencepiece("\n".join(texts[:50]), TokenizerSection(vocab_size=args.vocab))
        )
        section = DataSection(sources=[str(work / "data")], max_bytes=None, cache_dir=str(work / "cache"))
        times: dict[str, list[float]] = {k: [] for k in ("reread", "first", "cached", "hashed", "indexed")}
        tokens = file_tokens([str(work / "data")], tokenizer, str(work / "cache"))  # the recipe cache made
        open_corpus(section, None, None, False, pretrained=tokenizer)
        for round_ in range(args.repeats):
            clock = time.perf_counter()
            assert reread(work / "data", tokenizer) == len(tokens)
            times["reread"].append(time.perf_counter() - clock)
            fresh = work / f"fresh{round_}"
            clock = time.perf_counter()
            assert len(file_tokens([str(work / "data")], tokenizer, str(fresh))) == len(tokens)
            times["first"].append(time.perf_counter() - clock)
            clock = time.perf_counter()
            assert len(file_tokens([str(work / "data")], tokenizer, str(work / "cache"))) == len(tokens)
            times["cached"].append(time.perf_counter() - clock)
            shutil.rmtree(work / "cache" / "text-index")  # the text is read and hashed again
            clock = time.perf_counter()
            open_corpus(section, None, None, False, pretrained=tokenizer)
            times["hashed"].append(time.perf_counter() - clock)
            clock = time.perf_counter()
            open_corpus(section, None, None, False, pretrained=tokenizer)
            times["indexed"].append(time.perf_counter() - clock)
        median = {k: statistics.median(v) for k, v in times.items()}
        chars = read_text([str(work / "data")], section, None).chars
        result = {
            "benchmark": "eval_data",
            "machine": machine(),
            "files": args.files,
            "chars": chars,
            "tokens": len(tokens),
            "repeats": args.repeats,
            **{
                f"{'data' if k in ('reread', 'first', 'cached') else 'recipe'}_{k}_s": round(v, 4)
                for k, v in median.items()
            },
            "data_speedup": round(median["reread"] / median["cached"], 1),
            "recipe_speedup": round(median["hashed"] / median["indexed"], 1),
        }
        m = median
        print(
            f"--data: {m['reread']:.3f} s read and tokenized each eval (before), {m['first']:.3f} s the first eval "
            f"now, {m['cached']:.3f} s every later one: x{result['data_speedup']}; recipe text: "
            f"{m['hashed']:.3f} s read and hashed, {m['indexed']:.3f} s by its index: x{result['recipe_speedup']}"
        )
        return emit(result, args.json)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
