"""Token files other tools wrote, mixtures by weight, and windows that resume on any world size
(yamlformer.recipes.data.megatron, yamlformer.recipes.data.mixture, yamlformer.recipes.data.windows)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from yamlformer.recipes.data.megatron import Part, read_megatron, read_raw, write_megatron
from yamlformer.recipes.data.mixture import BLOCK, Blend, Source, Stream
from yamlformer.recipes.data.windows import IGNORE, Mixture, TrainWindows, ValWindows, to_batch
from yamlformer.recipes.errors import RecipeError


def documented_megatron(prefix, documents, code=8, dtype="<u2"):
    """A Megatron-LM dataset written byte by byte from its documented layout (not our writer)."""
    lengths = [len(d) for d in documents]
    with open(f"{prefix}.bin", "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=dtype).tobytes())
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1])]) * itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(documents)))
        f.write(struct.pack("<Q", len(documents) + 1))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(lengths)}q", *pointers.tolist()))
        f.write(struct.pack(f"<{len(documents) + 1}q", *range(len(documents) + 1)))


def some_documents(n=40, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 60))) for _ in range(n)]


@pytest.mark.parametrize("code,dtype", [(8, "<u2"), (4, "<i4")])
def test_a_megatron_dataset_reads_back_the_ids_its_layout_holds(tmp_path, code, dtype):
    documents = some_documents()
    documented_megatron(tmp_path / "corpus_text_document", documents, code, dtype)
    for given in ("corpus_text_document", "corpus_text_document.bin", "corpus_text_document.idx"):
        from yamlformer.recipes.data.megatron import megatron_prefix

        part = read_megatron(megatron_prefix(tmp_path / given))
        assert np.array_equal(np.asarray(part.tokens), np.concatenate(documents))
        assert part.ends.tolist() == np.cumsum([len(d) for d in documents]).tolist()
    write_megatron(tmp_path / "ours", documents, np.dtype(dtype).newbyteorder("="))
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "corpus_text_document.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "corpus_text_document.bin").read_bytes()


def test_a_file_that_is_not_megatron_is_refused_naming_it(tmp_path):
    documents = some_documents(5)
    documented_megatron(tmp_path / "d", documents)
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(b"NOTMEGA\x00\x00" + idx[9:])
    with pytest.raises(RecipeError, match=r"d\.idx: not a Megatron-LM index"):
        read_megatron(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(idx)
    data = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(data[:-4])
    with pytest.raises(RecipeError, match=r"d\.bin: .* bytes, its index says"):
        read_megatron(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(idx[:30])
    with pytest.raises(RecipeError, match="truncated"):
        read_megatron(tmp_path / "d")


def test_a_raw_token_file_is_read_in_place_and_an_odd_size_refused(tmp_path):
    ids = np.arange(5000, dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")
    part = read_raw(tmp_path / "train.bin", "uint16")
    assert isinstance(part.tokens, np.memmap) and np.array_equal(part.tokens, ids) and part.ends is None
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 5)
    with pytest.raises(RecipeError, match=r"odd\.bin: 5 bytes is not a whole number of uint16"):
        read_raw(tmp_path / "odd.bin", "uint16")


def stream(n_tokens, seq_len, ends=None, start=0, shift=False):
    return Stream([Part(np.arange(start, start + n_tokens, dtype=np.int64), ends, None)], seq_len, shift)


def first_tokens(mixture, batch_size, world, position, steps, accumulate=1):
    """The first id of every window ``steps`` steps take on ``world`` ranks from ``position``."""
    seen = []
    iters = [iter(TrainWindows(mixture, batch_size, r, world, position, accumulate)) for r in range(world)]
    for _ in range(steps):
        for _ in range(accumulate):
            for it in iters:
                seen += next(it)[0][:, 0].tolist()
    return seen


@pytest.mark.parametrize("first_world,second_world", [(2, 1), (1, 2)])
def test_resuming_on_another_world_size_sees_every_window_of_an_epoch_once(first_world, second_world):
    seq_len, batch = 8, 4
    train = stream(8 * 97, seq_len, shift=True)  # room to cut at any offset in [0, 8)
    mixture = Mixture([Source("a", train, stream(200, seq_len))], seed=3, vocab_size=10_000)
    assert mixture.train.streams[0].n_windows == 96  # 12 steps of 8 windows at world 2, 24 at world 1
    before = first_tokens(mixture, batch, first_world, 0, steps=6)
    taken = 6 * batch * first_world
    after = first_tokens(mixture, batch, second_world, taken, steps=(96 - taken) // (batch * second_world))
    seen = before + after
    offset = min(seen)
    assert len(seen) == 96 and sorted(seen) == list(range(offset, offset + 96 * seq_len, seq_len))
    unbroken = first_tokens(mixture, batch, 1, 0, steps=24)
    assert seen == unbroken  # the same windows in the same order as one rank that never stopped


def test_one_global_batch_is_the_same_windows_however_it_is_split():
    mixture = Mixture([Source("a", stream(5000, 8), stream(200, 8))], seed=1, vocab_size=10_000)
    one = first_tokens(mixture, 8, 1, 0, steps=3)
    two = first_tokens(mixture, 4, 2, 0, steps=3)
    accumulated = first_tokens(mixture, 2, 2, 0, steps=3, accumulate=2)
    assert sorted(one[:8]) == sorted(two[:8]) == sorted(accumulated[:8])
    assert one == two == accumulated


def test_a_mixture_follows_its_weights_in_every_prefix_and_repeats_a_source_only_by_epochs():
    small, large = stream(8 * 50 + 1, 8, start=0), stream(8 * 5000 + 1, 8, start=10**6)
    mixture = Mixture(
        [Source("small", small, None, 1.0), Source("large", large, stream(100, 8), 3.0)], seed=0, vocab_size=10**7
    )
    labels, within = mixture.train.blend.locate(0, 4 * BLOCK)
    counts = np.cumsum(np.stack([labels == 0, labels == 1]), axis=1)
    g = np.arange(1, 4 * BLOCK + 1)
    assert np.all(np.abs(counts[0] - g * 0.25) <= 2) and np.all(np.abs(counts[1] - g * 0.75) <= 2)
    for source in (0, 1):
        assert np.array_equal(within[labels == source], np.arange(int((labels == source).sum())))
    seen = first_tokens(mixture, 16, 1, 0, steps=25)  # 400 windows: ~100 of small (2 epochs of 50)
    from_small = [t for t in seen if t < 10**6]
    epoch_one = from_small[:50]
    assert sorted(epoch_one) == list(range(0, 400, 8))  # its first epoch: each window once
    assert len(set(from_small)) == 50  # then the same windows again, in another order
    assert Blend(np.array([1.0, 3.0]), 0, 0).locate(2000, 100)[0].tolist() == labels[2000:2100].tolist()


def test_each_training_epoch_cuts_the_windows_at_another_offset():
    mixture = Mixture([Source("a", stream(8 * 11, 8, shift=True), stream(100, 8))], seed=0, vocab_size=10_000)
    seen = first_tokens(mixture, 10, 1, 0, steps=4)  # 4 epochs of 10 windows
    epochs = [sorted(seen[i : i + 10]) for i in range(0, 40, 10)]
    offsets = [e[0] for e in epochs]
    assert all(e == list(range(o, o + 80, 8)) for e, o in zip(epochs, offsets))
    assert len(set(offsets)) > 1 and all(0 <= o < 8 for o in offsets)


def test_validation_windows_are_the_same_at_every_validation():
    mixture = Mixture([Source("a", stream(1000, 8), stream(400, 8))], seed=2, vocab_size=10_000)
    runs = [[b[0][:, 0].tolist() for b in ValWindows(mixture, 4, 3, 0, 1)] for _ in range(2)]
    assert runs[0] == runs[1] and len(sum(runs[0], [])) == 12
    halves = [[b[0][:, 0].tolist() for b in ValWindows(mixture, 2, 3, r, 2)] for r in (0, 1)]
    assert [a + b for a, b in zip(*halves)] == runs[0]


def test_a_document_masked_batch_restarts_documents_and_drops_targets_across_them():
    ends = np.array([3, 5, 12, 20])
    ids, documents = stream(20, 9, ends).window(0)
    assert documents.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    inputs, targets, document_ids = to_batch(ids[None], documents[None], "doc_masked")
    assert document_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert targets.tolist() == [[1, 2, IGNORE, 4, IGNORE, 6, 7, 8, 9]]
    second = stream(20, 9, ends).window(1)[1]
    assert second[0] == 0  # numbered from the window's first token
    assert len(to_batch(ids[None], documents[None], "concat")) == 2


def test_an_id_outside_the_vocabulary_names_its_source():
    mixture = Mixture([Source("web.tok", stream(1000, 8), stream(100, 8))], seed=0, vocab_size=500)
    with pytest.raises(RecipeError, match=r"web\.tok: token id \d+ is outside the tokenizer's vocabulary of 500"):
        for _ in zip(range(50), TrainWindows(mixture, 4, 0, 1, 0)):
            pass


def test_the_data_position_counts_windows_across_world_sizes():
    from yamlformer.recipes.data.windows import LMDataModule

    mixture = Mixture([Source("a", stream(5000, 8), stream(200, 8))], seed=0, vocab_size=10_000)
    data = LMDataModule(mixture, batch_size=4, seed=0, val_batches=2, accumulate=2, num_workers=0)
    data.load_state_dict({"windows": 40, "step": 5, "seed": 0})
    assert data.windows_taken(5) == 40 and data.windows_taken(7) == 40 + 2 * 4 * 2
    assert data.state_dict() == {"windows": 40, "step": 5, "seed": 0}
    first = next(iter(data.train_dataloader()))[0]
    expected = next(iter(TrainWindows(mixture, 4, 0, 1, 40, 2)))[0]
    assert torch.equal(first, expected)


def test_a_part_pickles_as_its_file_so_a_spawned_worker_maps_it_again(tmp_path):
    import pickle

    from yamlformer.recipes.data.corpus import tail_split

    np.arange(1_000_000, dtype=np.uint32).tofile(tmp_path / "big.bin")
    train, held = tail_split(read_raw(tmp_path / "big.bin", "uint32"), 0.1)
    for part in (train, held):
        payload = pickle.dumps(part)
        assert len(payload) < 1000  # the name, not 4 MB of tokens
        again = pickle.loads(payload)
        assert isinstance(again.tokens, np.memmap) and np.array_equal(again.tokens, part.tokens)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_an_epoch_order_is_a_permutation_in_constant_memory(n):
    from yamlformer.recipes.data.mixture import epoch_order

    offset, order = epoch_order(0, 0, 0, 0, n, seq_len=8)
    assert sorted(order[k] for k in range(n)) == list(range(n)) and 0 <= offset < 8
    if n >= 64:
        other = epoch_order(0, 0, 0, 1, n, seq_len=8)[1]
        assert [order[k] for k in range(20)] != [other[k] for k in range(20)]  # each epoch its own order
        assert [order[k] for k in range(20)] != list(range(20))
