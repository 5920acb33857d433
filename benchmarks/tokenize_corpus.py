"""`builder tokenize` against the way a user tokenizes without it: Hugging Face `datasets`.

    python benchmarks/tokenize_corpus.py [--gb 0.2] [--workers 1,2] [--rounds 1] [--work DIR] [--keep] [--json FILE]

A seeded corpus of ``--gb`` GB of text is written under ``--work`` (default: a temporary folder;
never the repository): equal thirds of plain text files (documents between blank lines), JSON
Lines (``id``, ``url``, ``text``) and Parquet (the same columns, snappy), documents of mixed
lengths (log-normal, 1 to 400 sentences) made of words drawn from a Zipf distribution over a
50,000-word vocabulary (1% non-ASCII), with punctuation and line breaks. A byte-level BPE
``tokenizer.json`` (8,192 pieces and ``<|endoftext|>``, trained with ``tokenizers`` on the first
20 MB) is used by both sides, each document followed by that EOS.

For each worker count N, in the same run, each in a fresh process:

- **ours**: ``builder tokenize CORPUS -o OUT --tokenizer tokenizer.json --separator '\\n\\n'
  --workers N`` (N tokenizing processes, one thread each);
- **theirs**: ``load_dataset`` of the same files (``text`` with ``sample_by="paragraph"``,
  ``json``, ``parquet``) into Arrow, concatenated, then ``.map(batched=True, num_proc=N)`` with
  the same tokenizer's ``encode_batch``, writing its cache (``num_proc=1``: in the process, as
  ``datasets`` runs it). ``RAYON_NUM_THREADS=1`` so each of their processes uses one core too:
  both sides get N cores for tokenizing.

Printed: wall seconds, MB/s of corpus text, tokens/s, the ratio ours/theirs, the peak RSS of the
whole process tree (psutil samples the process and all its children every 0.1 s and sums their
RSS; "private" subtracts shared pages, which for `datasets` include the memory-mapped Arrow files
it reads) and the CPU seconds of the tree; with ``--rounds R``, the fastest of R runs of each
side (run in turning order). The token counts of both sides are checked equal. The last line is
JSON. ``--keep`` leaves the corpus and our last output (``WORK/ours``) in place.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also under python -P
from machine import emit, machine

REPO = Path(__file__).resolve().parents[1]
SEED = 1234
VOCABULARY = 50_000
SENTENCES = 200_000
TOKENIZER_SAMPLE = 20 << 20
EOS = "<|endoftext|>"


# -- the corpus ------------------------------------------------------------------------------------


def _words(rng) -> list[str]:
    """VOCABULARY pseudo-words from syllables, most frequent first; 1% with non-ASCII letters."""
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "j",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "z",
        "ch",
        "sh",
        "th",
        "st",
        "tr",
        "pl",
        "gr",
    ]
    vowels = ["a", "e", "i", "o", "u", "ou", "ea", "io", "ai"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng"]
    accents = ["é", "ü", "ö", "ñ", "ç", "å", "ø", "日", "本"]
    seen: dict[str, None] = {}
    while len(seen) < VOCABULARY:
        n = int(rng.choice([1, 1, 2, 2, 2, 3, 3, 4]))
        word = "".join(str(rng.choice(onsets)) + str(rng.choice(vowels)) + str(rng.choice(codas)) for _ in range(n))
        if rng.random() < 0.01:
            cut = int(rng.integers(0, len(word) + 1))
            word = word[:cut] + str(rng.choice(accents)) + word[cut:]
        seen.setdefault(word, None)
    return list(seen)


def sentence_pool(seed: int) -> list[str]:
    """SENTENCES sentences of Zipf-drawn words, each ending in a space or (15%) a line break."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = _words(rng)
    ranks = np.arange(1, VOCABULARY + 1, dtype=np.float64)
    p = ranks**-1.1
    p /= p.sum()
    lengths = rng.integers(3, 26, size=SENTENCES)
    picks = rng.choice(VOCABULARY, size=int(lengths.sum()), p=p)
    marks = rng.choice([".", ".", ".", "?", "!", ":", ";", "..."], size=SENTENCES)
    breaks = rng.random(SENTENCES) < 0.15
    commas = rng.random(SENTENCES) < 0.4
    numbers = rng.random(SENTENCES) < 0.1
    pool, start = [], 0
    for i, n in enumerate(lengths.tolist()):
        chosen = [words[j] for j in picks[start : start + n].tolist()]
        start += n
        if commas[i]:
            chosen[len(chosen) // 2] += ","
        if numbers[i]:
            chosen.append(str(int(rng.integers(0, 100_000))))
        text = " ".join(chosen)
        pool.append(text[0].upper() + text[1:] + str(marks[i]) + ("\n" if breaks[i] else " "))
    return pool


def documents(rng, pool: list[str], target: int):
    """Documents of about ``target`` bytes in all (log-normal sentence counts, 1 to 400)."""
    size = 0
    while size < target:
        counts = rng.lognormal(2.3, 1.0, size=2000).astype(int).clip(1, 400)
        picks = rng.integers(0, len(pool), size=int(counts.sum())).tolist()
        start = 0
        for n in counts.tolist():
            doc = "".join([pool[i] for i in picks[start : start + n]]).rstrip()
            start += n
            size += len(doc.encode("utf-8"))
            yield doc
            if size >= target:
                return


def make_corpus(folder: Path, gb: float) -> dict:
    """The corpus's three thirds under ``folder`` (kept when already there for this size)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    stamp = folder.parent / "corpus.json"
    if stamp.is_file():
        info = json.loads(stamp.read_text())
        if info["gb"] == gb and info["seed"] == SEED:
            return info
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started = time.perf_counter()
    pool = sentence_pool(SEED)
    part = int(gb * 1e9 / 3)
    per_file = int(min(256e6, max(1e6, part / 8)))
    counts = {"text": 0, "jsonl": 0, "parquet": 0}
    text_bytes = 0
    for kind, offset in (("text", 1), ("jsonl", 2), ("parquet", 3)):
        rng = np.random.default_rng([SEED, offset])
        for index in range(max(1, round(part / per_file))):
            docs = list(documents(rng, pool, per_file))
            counts[kind] += len(docs)
            text_bytes += sum(len(d.encode("utf-8")) for d in docs)
            name = folder / f"{kind}-{index:03d}"
            if kind == "text":
                name.with_suffix(".txt").write_text("\n\n".join(docs), encoding="utf-8")
            elif kind == "jsonl":
                with open(name.with_suffix(".jsonl"), "w", encoding="utf-8") as f:
                    for i, doc in enumerate(docs):
                        f.write(
                            json.dumps(
                                {"id": f"{index}-{i}", "url": f"https://example.com/{index}/{i}", "text": doc},
                                ensure_ascii=False,
                            )
                            + "\n"
                        )
            else:
                ids = [f"{index}-{i}" for i in range(len(docs))]
                table = pa.table({"id": ids, "url": [f"https://example.com/{i}" for i in ids], "text": docs})
                pq.write_table(table, name.with_suffix(".parquet"), row_group_size=8192)
            del docs
    files = sorted(p.name for p in folder.iterdir() if p.suffix in (".txt", ".jsonl", ".parquet"))
    info = {
        "gb": gb,
        "seed": SEED,
        "files": files,
        "documents": counts,
        "text_bytes": text_bytes,
        "stored_bytes": sum((folder / f).stat().st_size for f in files),
        "seconds": time.perf_counter() - started,
    }
    stamp.write_text(json.dumps(info))
    return info


def make_tokenizer(corpus: Path, path: Path) -> None:
    """A byte-level BPE of 8,192 pieces and EOS, trained on the first 20 MB of the text files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if path.is_file():
        return
    sample, size = [], 0
    for name in sorted(corpus.glob("text-*.txt")):
        with open(name, encoding="utf-8") as f:
            for doc in f.read(TOKENIZER_SAMPLE - size).split("\n\n"):
                sample.append(doc)
                size += len(doc)
        if size >= TOKENIZER_SAMPLE * 0.9:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192, special_tokens=[EOS], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(sample, trainer)
    tokenizer.save(str(path))


# -- the two sides -----------------------------------------------------------------------------------


def theirs(corpus: str, tokenizer_file: str, workers: int, cache: str, result: str) -> None:
    """The `datasets` side, in this (fresh) process."""
    from pathlib import Path

    import pyarrow.compute as pc
    from datasets import concatenate_datasets, disable_progress_bars, load_dataset
    from tokenizers import Tokenizer

    disable_progress_bars()
    folder = Path(corpus)
    tokenizer = Tokenizer.from_file(tokenizer_file)
    eos = tokenizer.token_to_id(EOS)
    files = {
        kind: sorted(str(p) for p in folder.glob(f"*.{suffix}"))
        for kind, suffix in (("text", "txt"), ("json", "jsonl"), ("parquet", "parquet"))
    }
    parts = [
        load_dataset("text", data_files=files["text"], sample_by="paragraph", split="train", cache_dir=cache),
        load_dataset("json", data_files=files["json"], split="train", cache_dir=cache).select_columns(["text"]),
        load_dataset("parquet", data_files=files["parquet"], split="train", cache_dir=cache).select_columns(["text"]),
    ]
    data = concatenate_datasets(parts)

    def tokenize(batch):
        return {"input_ids": [e.ids + [eos] for e in tokenizer.encode_batch(batch["text"], add_special_tokens=False)]}

    out = data.map(
        tokenize,
        batched=True,
        num_proc=workers if workers > 1 else None,
        remove_columns=["text"],
        cache_file_name=str(Path(cache) / "tokenized.arrow"),
    )
    tokens = int(pc.sum(pc.list_value_length(out.data.column("input_ids"))).as_py())
    Path(result).write_text(json.dumps({"tokens": tokens, "documents": len(out)}))


def measure(command: list[str], env: dict) -> dict:
    """Run ``command``; its wall seconds, the peak RSS (and private RSS) of its process tree, CPU seconds."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = {"rss": 0, "private": 0}
    cpu: dict[int, float] = {}  # per process of the tree, its CPU seconds when last seen
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(process.pid)
        while not done.is_set():
            rss = private = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        with p.oneshot():
                            info, times = p.memory_info(), p.cpu_times()
                    except psutil.Error:
                        continue
                    rss += info.rss
                    private += info.rss - getattr(info, "shared", 0)
                    cpu[p.pid] = times.user + times.system
            except psutil.Error:
                pass
            peak["rss"], peak["private"] = max(peak["rss"], rss), max(peak["private"], private)
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = process.communicate()[0]
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if process.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... failed ({process.returncode}):\n{output[-4000:]}")
    # the reaped tree's CPU (every process its parent waited for), or what sampling saw when more (a
    # pool's forkserver and its workers are never waited for by the process that started them)
    waited = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "seconds": seconds,
        "peak_rss": peak["rss"],
        "peak_private": peak["private"],
        "cpu_seconds": max(waited, sum(cpu.values())),
        "output": output,
    }


def run_ours(corpus: Path, tokenizer: Path, out: Path, workers: int, env: dict) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "yamlformer.builder.cli",
        "tokenize",
        str(corpus),
        "-o",
        str(out),
        "--tokenizer",
        str(tokenizer),
        "--separator",
        r"\n\n",
        "--workers",
        str(workers),
        "--json",
    ]
    result = measure(command, env)
    summary = json.loads(result.pop("output").strip().splitlines()[-1])
    tokens = sum(s["tokens"] for s in summary["splits"].values())
    return {**result, "tokens": tokens, "documents": sum(s["documents"] for s in summary["splits"].values())}


def run_theirs(corpus: Path, tokenizer: Path, cache: Path, workers: int, env: dict) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    answer = cache.parent / "theirs.json"
    command = [sys.executable, __file__, "--theirs", str(corpus), str(tokenizer), str(workers), str(cache), str(answer)]
    result = measure(
        command, dict(env, HF_HOME=str(cache / "home"), HF_DATASETS_CACHE=str(cache), HF_DATASETS_OFFLINE="1")
    )
    result.pop("output")
    counts = json.loads(answer.read_text())
    shutil.rmtree(cache, ignore_errors=True)
    return {**result, **counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=0.2, help="corpus size in GB of text (default 0.2)")
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated (default 1,2)")
    parser.add_argument("--work", help="where the corpus and outputs go (default: a temporary folder, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and our last output (WORK/ours)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each side per worker count, in turning order; the fastest of each is shown (default 1)",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--theirs", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.theirs:
        corpus, tokenizer, workers, cache, result = args.theirs
        theirs(corpus, tokenizer, int(workers), cache, result)
        return 0
    counts = [int(w) for w in args.workers.split(",")]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tokbench-"))
    if REPO in [work.resolve(), *work.resolve().parents]:
        raise SystemExit(f"--work {work}: inside the repository; give a folder outside it")
    work.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        RAYON_NUM_THREADS="1",
        PYTHONSAFEPATH="1",
    )
    print(
        f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}; started {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    corpus = make_corpus(work / "corpus", args.gb)
    tokenizer = work / "tokenizer.json"
    make_tokenizer(work / "corpus", tokenizer)
    mb = corpus["text_bytes"] / 1e6
    print(
        f"corpus: {mb:,.0f} MB of text in {len(corpus['files'])} files ({corpus['stored_bytes'] / 1e6:,.0f} MB "
        f"stored; thirds text / JSONL / Parquet), {sum(corpus['documents'].values()):,} documents, under {work}; "
        f"byte-level BPE of 8,192 pieces",
        flush=True,
    )
    rows = []
    sides = {
        "ours": lambda w: run_ours(work / "corpus", tokenizer, work / "ours", w, env),
        "theirs": lambda w: run_theirs(work / "corpus", tokenizer, work / "hf-cache", w, env),
    }
    try:
        for workers in counts:
            runs: dict[str, list[dict]] = {"ours": [], "theirs": []}
            for round_ in range(args.rounds):
                # the order turns each round, so a busy minute of a shared machine falls on each side in turn
                for side in ("ours", "theirs") if round_ % 2 == 0 else ("theirs", "ours"):
                    result = sides[side](workers)
                    runs[side].append(result)
                    print(
                        f"workers {workers} round {round_ + 1} {side:6s}: {result['seconds']:8.1f} s, peak RSS "
                        f"{result['peak_rss'] / 2**30:.2f} GiB, {result['tokens']:,} tokens",
                        flush=True,
                    )
            ours, them = (min(runs[side], key=lambda r: r["seconds"]) for side in ("ours", "theirs"))
            if ours["tokens"] != them["tokens"] or ours["documents"] != them["documents"]:
                print(
                    f"  note: token counts differ: ours {ours['tokens']:,} in {ours['documents']:,} documents, "
                    f"theirs {them['tokens']:,} in {them['documents']:,}",
                    flush=True,
                )
            rows.append(
                {
                    "workers": workers,
                    "ours": ours,
                    "theirs": them,
                    "runs": runs,
                    "ratio": them["seconds"] / ours["seconds"],
                }
            )
    finally:
        if not args.keep:
            shutil.rmtree(work / "ours", ignore_errors=True)
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.gb:g} GB corpus ({mb:,.0f} MB of text): builder tokenize vs datasets load_dataset + map")
    print(
        f"{'workers':>7s}  {'side':<18s} {'seconds':>8s} {'MB/s':>7s} {'Mtok/s':>7s} {'ratio':>6s} "
        f"{'peak RSS':>9s} {'private':>8s} {'CPU s':>7s}"
    )
    for row in rows:
        for side, name in (("ours", "builder tokenize"), ("theirs", "datasets map")):
            r = row[side]
            ratio = f"{row['ratio']:5.2f}x" if side == "ours" else ""
            print(
                f"{row['workers']:7d}  {name:<18s} {r['seconds']:8.1f} {mb / r['seconds']:7.1f} "
                f"{r['tokens'] / r['seconds'] / 1e6:7.2f} {ratio:>6s} {r['peak_rss'] / 2**30:7.2f} G "
                f"{r['peak_private'] / 2**30:6.2f} G {r['cpu_seconds']:7.1f}"
            )
    print(f"tokens: {rows[0]['ours']['tokens']:,} (ours), {rows[0]['theirs']['tokens']:,} (theirs)" if rows else "")
    return emit({"machine": machine(), "gb": args.gb, "corpus": corpus, "work": str(work), "rows": rows}, args.json)


if __name__ == "__main__":
    sys.exit(main())
