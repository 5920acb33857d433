"""`builder tokenize` and the tokenized-dataset format (recipes/data/README.md): every source
format read as documents, ids equal to the tokenizer's plus EOS, the same bytes on 1 and 2
workers, a resume after SIGKILL that re-tokenizes nothing finished, and one line per bad input
naming file and line or row (a damaged or foreign dataset: tests/test_tokenized_integrity.py)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hostile_helpers import cli, refused
from tokenize_helpers import WORDS, docs, sp  # noqa: F401 (sp: a fixture)

from yamlformer.recipes.data.sources import Document, DocumentStream, find_sources
from yamlformer.recipes.data.tokenize import tokenize_documents
from yamlformer.recipes.data.tokenized import TokenizedDataset, is_tokenized_dataset
from yamlformer.recipes.errors import RecipeError

REPO = Path(__file__).resolve().parents[1]


def dataset_bytes(folder: Path) -> dict[str, bytes]:
    """Every file a dataset consists of (not the lock, stamps or run records), by name."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    }


def read_back(dataset: TokenizedDataset, split: str) -> list[list[int]]:
    return [shard.document(i).tolist() for shard in dataset.shards(split) for i in range(shard.n_documents)]


# -- what is written -----------------------------------------------------------------------------------


def test_ids_are_the_tokenizers_per_document_with_eos(tmp_path, sp):
    tokenizer, _ = sp
    texts = docs(300)
    dataset = tokenize_documents(
        [Document(t, None, "mem") for t in texts],
        tokenizer,
        tmp_path / "ds",
        val_fraction=0.2,
        shard_bytes=4000,
        progress=False,
    )
    assert tokenizer.eos_id == 1 and dataset.eos_id == 1 and dataset.dtype == np.dtype("<u2")
    assert len(dataset.shards("train")) > 3
    held = [t for t in texts if _held(t, 0.2)]
    kept = [t for t in texts if not _held(t, 0.2)]
    assert 20 < len(held) < 100
    assert read_back(dataset, "train") == [tokenizer.encode(t) + [1] for t in kept]
    assert read_back(dataset, "validation") == [tokenizer.encode(t) + [1] for t in held]
    assert dataset.tokens("train") + dataset.tokens("validation") == sum(len(tokenizer.encode(t)) + 1 for t in texts)
    assert dataset.documents("train") == len(kept) and dataset.tokenizer().fingerprint() == tokenizer.fingerprint()
    for shard in dataset.shards("train"):
        assert shard.ends[-1] == len(shard.tokens) and not shard.tokens.flags.writeable


def _held(text: str, fraction: float) -> bool:
    import hashlib

    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") < fraction * 2**64


def test_a_tokenizer_json_and_a_char_table(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from yamlformer.recipes.data.tokenizers import CharTokenizer, HFTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        docs(300),
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    hf = HFTokenizer(bpe.to_str())
    texts = docs(50, seed=3)
    assert hf.eos_id == 0 and hf.encode_batch(texts[:2]) == [bpe.encode(t).ids for t in texts[:2]]
    dataset = tokenize_documents([Document(t) for t in texts], hf, tmp_path / "hf", progress=False)
    assert read_back(dataset, "train") == [bpe.encode(t).ids + [0] for t in texts]
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and dataset.tokenizer().fingerprint() == hf.fingerprint()

    char = CharTokenizer.fit("".join(texts))
    dataset = tokenize_documents([Document(t) for t in texts], char, tmp_path / "char", progress=False)
    assert dataset.eos_id is None and read_back(dataset, "train") == [char.encode(t) for t in texts]
    assert dataset.tokenizer().chars == char.chars


def test_the_command_takes_a_model_a_tokenizer_json_and_a_hugging_face_folder(capsys, tmp_path, sp):
    from yamlformer.builder.hf.tokenizer import write_tokenizer

    tokenizer, model = sp
    texts = docs(40, seed=8)
    (tmp_path / "a.txt").write_text("\n\n".join(texts), encoding="utf-8")
    write_tokenizer(tokenizer.state(), tmp_path / "hf")  # the same model as Hugging Face writes it
    made = {}
    for name, tok in (("model", model), ("json", tmp_path / "hf" / "tokenizer.json"), ("folder", tmp_path / "hf")):
        result = cli(
            capsys,
            "tokenize",
            tmp_path / "a.txt",
            "-o",
            tmp_path / name,
            "--tokenizer",
            tok,
            "--separator",
            r"\n\n",
            "--workers",
            "1",
            "--json",
        )
        assert result.status == 0, result.text
        summary = json.loads(result.out)
        assert summary["splits"]["train"]["documents"] == 40, summary
        made[name] = read_back(TokenizedDataset.open(tmp_path / name), "train")
    assert made["model"] == [tokenizer.encode(t) + [1] for t in texts]
    assert made["json"] == made["folder"] == made["model"]  # eos: tokenizer_config.json names </s>, id 1


def test_one_and_two_workers_write_the_same_bytes(tmp_path, sp):
    tokenizer, _ = sp
    texts = docs(400, seed=1)
    made = {}
    for workers in (1, 2):
        tokenize_documents(
            [Document(t, None, f"part{i % 3}") for i, t in enumerate(texts)],
            tokenizer,
            tmp_path / f"w{workers}",
            workers=workers,
            val_fraction=0.1,
            shard_bytes=3000,
            progress=False,
        )
        made[workers] = dataset_bytes(tmp_path / f"w{workers}")
    assert len([n for n in made[1] if n.endswith(".bin")]) > 10
    assert made[1] == made[2]


def test_a_cache_another_process_writes_is_waited_for_and_its_work_reused(tmp_path, sp, capsys):
    """Runs started together (a study's trials) fill one cache: the one that finds it locked waits
    for the holder and reuses what it wrote; `builder tokenize` into a held folder is refused."""
    fcntl = pytest.importorskip("fcntl")
    tokenizer, _ = sp
    documents = [Document(t, None, "a") for t in docs(60, seed=2)]
    out = tmp_path / "cache"
    first = tokenize_documents(documents, tokenizer, out, progress=False)
    holder = open(out / ".lock", "a+")  # noqa: SIM115  (another process's hold, closed by the timer)
    fcntl.flock(holder, fcntl.LOCK_EX)
    holder.seek(0)
    assert holder.read() == ""  # the first run let go and left no holder named
    holder.write("pid 4242 on elsewhere\n")
    holder.flush()
    with pytest.raises(RecipeError, match="being written by another `builder tokenize` \\(pid 4242 on elsewhere\\)"):
        tokenize_documents(documents, tokenizer, out, progress=False)
    threading.Timer(0.5, holder.close).start()
    started = time.monotonic()
    second = tokenize_documents(documents, tokenizer, out, progress=False, wait=True)
    assert time.monotonic() - started >= 0.4  # it waited for the holder
    assert f"waiting for pid 4242 on elsewhere, which is tokenizing into {out}" in capsys.readouterr().err
    assert second.stats["tokenized_units"] == 0 and second.stats["reused_units"] == first.stats["units"]
    assert read_back(second, "train") == read_back(first, "train")


def test_forced_splits_and_val_sources(tmp_path, sp):
    tokenizer, _ = sp
    documents = [
        Document("forced into validation", "validation", "a/x.txt"),
        Document("forced train", "train", "b"),
        Document("held out by its source", None, "held/one.jsonl"),
        Document("plain", None, "c"),
    ]
    dataset = tokenize_documents(
        documents,
        tokenizer,
        tmp_path / "ds",
        val_sources=["held"],
        progress=False,
        sources=[{"path": p, "format": "text", "bytes": 1} for p in ("a", "b", "held", "c")],
    )
    assert dataset.documents("validation") == 2 and dataset.documents("train") == 2
    assert [s["documents"] for s in dataset.manifest["sources"]] == [1, 1, 1, 1]
    with pytest.raises(RecipeError, match="split 'test' is none of train, validation"):
        tokenize_documents([Document("x", "test", "f")], tokenizer, tmp_path / "bad", progress=False)


# -- sources ------------------------------------------------------------------------------------------


def test_every_source_format_reads_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = docs(30, seed=4)
    lines = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)).encode()
    (tmp_path / "a.jsonl").write_bytes(lines + b"\n")  # a blank line is skipped
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (tmp_path / "d.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"id": range(30), "text": texts}), tmp_path / "e.parquet", row_group_size=7)
    table = pa.table({"text": texts})
    with pa.ipc.new_file(tmp_path / "f.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=8)
    with pa.ipc.new_stream(tmp_path / "g.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=8)
    (tmp_path / "h.txt").write_text("\n\n".join(texts), encoding="utf-8")
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.zst", "e.parquet", "f.arrow", "g.arrow"):
        (sources,) = find_sources([str(tmp_path / name)])
        assert [d.text for d in DocumentStream([sources])] == texts, name
    (sources,) = find_sources([str(tmp_path / "h.txt")])
    assert [d.text for d in DocumentStream([sources], separator="\n\n")] == texts
    assert [d.text for d in DocumentStream([sources])] == ["\n\n".join(texts)]  # no separator: one document


def test_a_separator_across_read_chunks(tmp_path, monkeypatch):
    import yamlformer.recipes.data.sources as sources_module

    monkeypatch.setattr(sources_module, "CHUNK", 7)  # separators and UTF-8 characters cut between reads
    texts = docs(20, seed=5)
    (tmp_path / "t.txt").write_text("<doc>".join(texts), encoding="utf-8")
    assert [d.text for d in DocumentStream(find_sources([str(tmp_path / "t.txt")]), separator="<doc>")] == texts


def test_datasets_save_to_disk_folders_and_plain_folders(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = docs(40, seed=6)
    datasets.Dataset.from_dict({"text": texts, "n": list(range(40))}).save_to_disk(str(tmp_path / "hf"), num_shards=2)
    (sources,) = find_sources([str(tmp_path / "hf")])
    assert sources.format == "hf-disk" and len(sources.files) == 2
    assert [d.text for d in DocumentStream([sources])] == texts
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": texts[:30]}),
            "validation": datasets.Dataset.from_dict({"text": texts[30:35]}),
            "test": datasets.Dataset.from_dict({"text": texts[35:]}),
        }
    )
    splits.save_to_disk(str(tmp_path / "corpus" / "dict"))
    (tmp_path / "corpus" / "z.txt").write_text("last", encoding="utf-8")
    (tmp_path / "corpus" / ".hidden").write_text("skipped", encoding="utf-8")
    (folder,) = find_sources([str(tmp_path / "corpus")])
    read = list(DocumentStream([folder]))
    assert [d.text for d in read] == texts[:35] + ["last"]
    assert [d.split for d in read] == ["train"] * 30 + ["validation"] * 5 + [None]
    assert folder.format == "arrow,text"


def test_every_real_file_is_read_once_however_links_reach_it(tmp_path):
    """A folder with a link to itself was read 41 times (a manifest of 41 documents); links to a
    folder elsewhere are followed, and a file reached twice (two links, a path given twice) is
    read once."""
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "a.txt").write_text("one", encoding="utf-8")
    (tmp_path / "loop" / "self").symlink_to("../loop")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("two", encoding="utf-8")
    (tmp_path / "loop" / "there").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "loop" / "there-again").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "loop" / "z.txt").symlink_to(tmp_path / "loop" / "a.txt")
    (folder,) = find_sources([str(tmp_path / "loop")])
    assert [d.text for d in DocumentStream([folder])] == ["one", "two"]
    loop = tmp_path / "loop"
    assert [f.name for f in folder.files] == [str(loop / "a.txt"), str(loop / "there" / "b.txt")]
    with pytest.raises(RecipeError, match="read already through an earlier source"):
        find_sources([str(tmp_path / "loop"), str(tmp_path / "elsewhere")])


def test_a_corpus_folder_in_a_recipe_reads_each_real_file_once(tmp_path):
    from yamlformer.recipes.data.corpus import read_text
    from yamlformer.recipes.recipe.sections import DataSection

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("one", encoding="utf-8")
    (tmp_path / "corpus" / "self").symlink_to("../corpus")
    (tmp_path / "corpus" / "b.md").symlink_to(tmp_path / "corpus" / "a.txt")
    paths = [str(tmp_path / "corpus"), str(tmp_path / "corpus" / "a.txt")]
    text = read_text(paths, DataSection(sources=paths, cache_dir=str(tmp_path / "cache")), None)
    assert text.texts == ["one"]


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_device_or_fifo_is_refused_in_one_line(capsys, tmp_path, sp, kind):
    if kind == "device":
        source = Path("/dev/zero")
    else:
        source = tmp_path / "fifo"
        os.mkfifo(source)
    result = cli(capsys, "tokenize", source, "-o", tmp_path / "ds", "--tokenizer", sp[1])
    refused(result, 1, str(source), "not a regular file or folder")


# -- bad inputs: one line each, naming the file and where --------------------------------------------


def _parquet_without_text(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"], "id": [1]}), path)


def _parquet_with_null(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", None]}), path)


def _damaged_parquet(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs(50)}), path)
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[: len(data) // 2]))


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


BAD = {
    "notjson.jsonl": (lambda p: p.write_bytes(b'{"text": "a"}\n{"text": "b"\n'), ["notjson.jsonl:2:", "not JSON"]),
    "nofield.jsonl": (
        lambda p: p.write_bytes(b'{"text": "a"}\n\n{"body": "b", "id": 2}\n'),
        ["nofield.jsonl:3:", "no field 'text'", "'body', 'id'", "--text-field"],
    ),
    "notstring.jsonl": (lambda p: p.write_bytes(b'{"text": 5}\n'), ["notstring.jsonl:1:", "is a JSON number"]),
    "array.json": (lambda p: p.write_bytes(b'[\n{"text": "a"}\n]\n'), ["array.json:1:", "one object a line"]),
    "latin1.txt": (
        lambda p: p.write_bytes(b"caf" + "é au lait".encode("latin-1")),
        ["latin1.txt", "not UTF-8", "byte 3"],
    ),
    "empty.txt": (lambda p: p.write_bytes(b""), ["empty.txt", "no documents"]),
    "blank.jsonl": (lambda p: p.write_bytes(b"\n\n"), ["blank.jsonl", "no documents"]),
    "nocolumn.parquet": (_parquet_without_text, ["nocolumn.parquet", "no column 'text'", "body, id"]),
    "null.parquet": (_parquet_with_null, ["null.parquet", "row 2", "null"]),
    "damaged.parquet": (_damaged_parquet, ["damaged.parquet", "not a readable Parquet file"]),
    "damaged.jsonl.gz": (
        lambda p: p.write_bytes(gzip.compress(b'{"text": "a"}\n' * 50)[:-20]),
        ["damaged.jsonl.gz", "a damaged gzip file"],
    ),
    "damaged.jsonl.zst": (
        lambda p: p.write_bytes(_zstd(b'{"text": "a"}\n' * 500)[:-30] + b"garbage!" * 4),
        ["damaged.jsonl.zst", "a damaged zstd file"],
    ),
    "packed.txt.xz": (lambda p: p.write_bytes(b"x"), ["packed.txt.xz", "does not read"]),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_input_is_one_line_naming_file_and_place(capsys, tmp_path, sp, name):
    make, needles = BAD[name]
    make(tmp_path / name)
    secret = "SECRET-CONTENT"
    result = cli(capsys, "tokenize", tmp_path / name, "-o", tmp_path / "ds", "--tokenizer", sp[1], "--workers", "1")
    err = refused(result, 1, *needles)
    assert err.startswith("builder tokenize: ") and secret not in err and '"b"' not in err


def test_out_of_range_arguments_name_the_argument_and_range(capsys, tmp_path, sp):
    (tmp_path / "a.txt").write_text("text")
    base = ["tokenize", tmp_path / "a.txt", "-o", tmp_path / "ds", "--tokenizer", sp[1]]
    refused(cli(capsys, *base, "--workers", "0"), 2, "argument --workers", "an integer from 1 to 1,024")
    refused(cli(capsys, *base, "--val-fraction", "1"), 2, "argument --val-fraction", "[0, 1)")
    refused(cli(capsys, *base, "--shard-mb", "0"), 2, "argument --shard-mb", "from 1 to 65,536")
    refused(cli(capsys, *base, "--val-sources", "nothing*"), 1, "--val-sources 'nothing*' matches none")
    refused(
        cli(capsys, "tokenize", tmp_path / "a.txt", "-o", tmp_path / "ds", "--tokenizer", tmp_path / "a.txt"),
        1,
        "--tokenizer",
        "not a sentencepiece model",
    )


# -- the command end to end, resumes and settings ---------------------------------------------------


def test_the_command_end_to_end_with_a_recipe_tokenizer(capsys, tmp_path):
    texts = docs(200, seed=7)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("\n\n".join(texts[:100]), encoding="utf-8")
    with open(tmp_path / "corpus" / "b.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[100:])
    recipe = tmp_path / "tok.yaml"
    recipe.write_text(
        f"model: {{spec: {REPO / 'specs' / 'tiny' / 'gpt2.yaml'}}}\n"
        "tokenizer: {type: sentencepiece, vocab_size: 320}\n"
    )
    argv = [
        "tokenize",
        tmp_path / "corpus",
        "-o",
        tmp_path / "ds",
        "--tokenizer",
        recipe,
        "--separator",
        r"\n\n",
        "--val-fraction",
        "0.1",
        "--workers",
        "1",
    ]
    result = cli(capsys, *argv)
    assert result.status == 0, result.text
    for needle in (
        "split",
        "train",
        "validation",
        "documents",
        "tokens",
        "shards",
        "corpus",
        "jsonl,text",
        "MB/s",
        "tokens/s",
        "200",
    ):
        assert needle in result.out, result.out
    dataset = TokenizedDataset.open(tmp_path / "ds")
    trained = dataset.tokenizer()
    assert trained.kind == "sentencepiece" and trained.vocab_size == 320 and dataset.eos_id == trained.eos_id == 1
    first = dataset_bytes(tmp_path / "ds")
    again = cli(capsys, *argv)  # the same command: everything reused, the trained tokenizer kept
    assert again.status == 0 and "already done" in again.out and "training" not in again.err, again.text
    assert dataset_bytes(tmp_path / "ds") == first
    changed = cli(capsys, *argv[:-4], "--val-fraction", "0.2", "--workers", "1")
    refused(changed, 1, "with other settings", "val_fraction: 0.1 there, 0.2 now", "--overwrite")
    assert cli(capsys, *argv[:-4], "--val-fraction", "0.2", "--overwrite").status == 0
    assert TokenizedDataset.open(tmp_path / "ds").manifest["split"]["val_fraction"] == 0.2
    refused(
        cli(capsys, "tokenize", tmp_path / "corpus", "-o", tmp_path / "corpus", "--tokenizer", recipe),
        1,
        "a folder with other files in it",
    )


KILLED = """
import os, random, signal
from pathlib import Path
from yamlformer.recipes.data.tokenizers import SentencePieceTokenizer
from yamlformer.recipes.data.sources import Document
from yamlformer.recipes.data.tokenize import tokenize_documents
WORDS = {words!r}
{docs}

def killed_stream():
    # 150 documents in, with about 15 units cut (at most 4 in flight): SIGKILL to the whole
    # process group, this process and its workers, mid-run
    for i, text in enumerate(docs(400, seed=2)):
        if i == 150:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        yield Document(text, None, "corpus")

out = Path({out!r})
tokenizer = SentencePieceTokenizer(Path({model!r}).read_bytes())
tokenize_documents(killed_stream(), tokenizer, out, workers=2, shard_bytes=3000, val_fraction=0.1, progress=False)
"""


def test_a_run_killed_by_sigkill_resumes_to_the_same_bytes(tmp_path, sp):
    tokenizer, model = sp
    out, whole = tmp_path / "killed", tmp_path / "whole"
    import inspect

    script = KILLED.format(words=WORDS, docs=inspect.getsource(docs), out=str(out), model=str(model))
    done = subprocess.run(
        [sys.executable, "-c", script],
        start_new_session=True,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert is_tokenized_dataset(out) and not (out / "manifest.json").exists()
    with pytest.raises(RecipeError, match="was not finished: rerun the same `builder tokenize` command to resume"):
        TokenizedDataset.open(out)
    records = sorted((out / ".units").glob("*.json"))
    assert len(records) >= 3
    finished = [json.loads(r.read_text()) for r in records]
    stats = {s["tokens"]: os.stat(out / s["tokens"]) for r in finished[1:] for s in r["shards"].values()}
    records[0].unlink()  # unit 0's shards now have no record: they must be written again, not trusted
    unit0 = os.stat(out / finished[0]["shards"]["train"]["tokens"])
    resumed = tokenize_documents(
        (Document(t, None, "corpus") for t in docs(400, seed=2)),
        tokenizer,
        out,
        workers=1,
        shard_bytes=3000,
        val_fraction=0.1,
        progress=False,
    )
    assert resumed.stats["reused_units"] == len(finished) - 1
    assert resumed.stats["tokenized_units"] == resumed.stats["units"] - len(finished) + 1
    for name, before in stats.items():  # reread, never re-tokenized: the very same files
        after = os.stat(out / name)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), name
    after = os.stat(out / finished[0]["shards"]["train"]["tokens"])
    assert (after.st_ino, after.st_mtime_ns) != (unit0.st_ino, unit0.st_mtime_ns)
    assert not list(out.rglob(".*.tmp-*"))
    tokenize_documents(
        (Document(t, None, "corpus") for t in docs(400, seed=2)),
        tokenizer,
        whole,
        workers=1,
        shard_bytes=3000,
        val_fraction=0.1,
        progress=False,
    )
    assert dataset_bytes(out) == dataset_bytes(whole)
