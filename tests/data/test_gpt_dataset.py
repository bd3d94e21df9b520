"""GPT samples: epoch coverage, split confinement, determinism, the index cache and batch fields."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megatron_pp.data import gpt_dataset
from megatron_pp.data.gpt_dataset import BatchOptions, GPTDataset, IndexCache, build_sample_index, make_batch
from megatron_pp.data.indexed import IndexedDataset
from tests.data import write_numbered_dataset

SEQ = 8
# 60 documents of 0..28 tokens (documents 0 and 29 empty); documents 10..49 form the split under test,
# 576 = 72 · SEQ tokens, so that epochs end on sample boundaries.
LENGTHS = [(7 * i) % 29 + (i == 10) for i in range(60)]
SPLIT = (10, 50)


@pytest.fixture
def corpus(tmp_path):
    prefix = str(tmp_path / "corpus")
    documents = write_numbered_dataset(prefix, LENGTHS)
    return IndexedDataset(prefix), documents


def _dataset(indexed, tmp_path, num_samples, seed=1, document_range=SPLIT, **kwargs):
    cache = IndexCache(str(tmp_path / "cache"), **kwargs)
    return GPTDataset(indexed, document_range, num_samples, seq_length=SEQ, seed=seed, options=BatchOptions(eod=-1),
                      cache=cache, split_name="train")


def _split_tokens(documents, document_range=SPLIT):
    return np.concatenate(documents[document_range[0] : document_range[1]])


def test_every_token_of_the_split_is_read_once_per_epoch(corpus, tmp_path):
    indexed, documents = corpus
    split_tokens = _split_tokens(documents)
    epoch_tokens = len(split_tokens)
    assert epoch_tokens % SEQ == 0, "the fixture is sized so that epochs end on sample boundaries"
    per_epoch = epoch_tokens // SEQ
    ds = _dataset(indexed, tmp_path, 2 * per_epoch + 3)  # two full epochs and a bit of a third
    inputs = [ds.sample(i)[:-1] for i in range(len(ds))]
    for epoch in range(2):
        seen = np.sort(np.concatenate(inputs[epoch * per_epoch : (epoch + 1) * per_epoch]))
        np.testing.assert_array_equal(seen, np.sort(split_tokens))


def test_samples_are_contiguous_document_pieces_inside_the_split(corpus, tmp_path):
    indexed, documents = corpus
    ds = _dataset(indexed, tmp_path, 150)
    firsts = {int(d[0]) for d in documents if len(d)}
    lasts = {int(d[-1]) for d in documents if len(d)}
    low, high = documents[SPLIT[0]][0], documents[SPLIT[1] - 1][-1]
    for i in range(len(ds)):
        sample = ds.sample(i)
        assert len(sample) == SEQ + 1 and sample.dtype == np.int64
        assert low <= sample.min() and sample.max() <= high, f"sample {i} reads outside documents {SPLIT}"
        for a, b in zip(sample[:-1].tolist(), sample[1:].tolist()):
            assert b == a + 1 and a not in lasts or (a in lasts and b in firsts), f"sample {i}: {a} -> {b}"


def test_same_seed_same_samples_other_seed_other_order(corpus, tmp_path):
    indexed, _ = corpus
    a = _dataset(indexed, tmp_path / "a", 40, seed=5)
    b = _dataset(indexed, tmp_path / "b", 40, seed=5)
    c = _dataset(indexed, tmp_path / "c", 40, seed=6)
    samples = lambda ds: np.stack([ds.sample(i) for i in range(len(ds))])  # noqa: E731
    np.testing.assert_array_equal(samples(a), samples(b))
    assert not np.array_equal(samples(a), samples(c))
    assert not np.array_equal(a.document_index, c.document_index)


def test_index_is_cached_and_keyed_by_content(corpus, tmp_path, monkeypatch):
    indexed, _ = corpus
    first = _dataset(indexed, tmp_path, 40)
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 4 and sum(f.endswith(".npy") for f in files) == 3

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached index should have been loaded")

    monkeypatch.setattr(gpt_dataset, "build_sample_index", no_rebuild)
    again = _dataset(indexed, tmp_path, 40)
    np.testing.assert_array_equal(first.shuffle_index, again.shuffle_index)
    # Another sample count (or seed, or split, or dataset content) is another key: built anew.
    with pytest.raises(AssertionError, match="should have been loaded"):
        _dataset(indexed, tmp_path, 41)


def test_non_builder_ranks_wait_and_load(corpus, tmp_path):
    indexed, _ = corpus
    calls = []
    built = _dataset(indexed, tmp_path, 30, barrier=lambda: calls.append("builder"))
    loaded = _dataset(indexed, tmp_path, 30, is_builder=False, barrier=lambda: calls.append("other"))
    assert calls == ["builder", "other"]  # one barrier per index, cache present or not
    np.testing.assert_array_equal(built.sample(3), loaded.sample(3))
    with pytest.raises(FileNotFoundError, match="must be a directory every rank sees"):
        _dataset(indexed, tmp_path, 31, is_builder=False, barrier=lambda: None)


def test_sample_index_rows_point_at_multiples_of_seq_length():
    lengths = np.array([3, 5, 0, 2, 9, 4])
    index = build_sample_index(lengths, num_samples=5, seq_length=4, seed=0)
    ends = np.cumsum(lengths[index["document_index"]])
    starts = ends - lengths[index["document_index"]]
    for i, (position, offset) in enumerate(index["sample_index"]):
        assert starts[position] + offset == 4 * i
        assert offset < lengths[index["document_index"][position]]  # never points into an empty document
    assert sorted(index["shuffle_index"].tolist()) == list(range(5))
    # 23 tokens per epoch, 5 samples need 21 tokens: one epoch.
    assert sorted(index["document_index"].tolist()) == list(range(6))


def test_epochs_are_added_until_the_samples_fit():
    index = build_sample_index(np.array([4, 4]), num_samples=5, seq_length=4, seed=0)  # needs 21 of 8 per epoch
    assert len(index["document_index"]) == 2 * 3
    # Samples of epoch e (first tokens in [8e, 8e + 8)) are shuffled among themselves only.
    assert sorted(index["shuffle_index"][:2].tolist()) == [0, 1]
    assert sorted(index["shuffle_index"][2:4].tolist()) == [2, 3]
    assert index["shuffle_index"][4] == 4


def test_batch_fields_match_the_documented_example():
    options = BatchOptions(eod=0, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    batch = make_batch(np.array([[5, 6, 0, 7, 8, 0, 9]]), options)
    assert batch["tokens"].tolist() == [[5, 6, 0, 7, 8, 0]]
    assert batch["labels"].tolist() == [[6, 0, 7, 8, 0, 9]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 6]
    assert batch["max_seqlen"] == 3
    assert batch["tokens"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32 and batch["position_ids"].dtype == torch.int64
    assert batch["cu_seqlens"].dtype == torch.int32


def test_batch_over_several_samples():
    samples = np.array([[1, 0, 2, 3, 4], [0, 5, 6, 0, 7], [8, 9, 1, 2, 3]])
    plain = make_batch(samples, BatchOptions(eod=0))
    assert set(plain) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert plain["loss_mask"].sum().item() == 12
    assert plain["position_ids"].tolist() == [[0, 1, 2, 3]] * 3
    full = make_batch(samples, BatchOptions(eod=0, eod_mask_loss=True, reset_position_ids=True,
                                            reset_attention_mask=True))
    assert full["loss_mask"].tolist() == [[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]]
    assert full["position_ids"].tolist() == [[0, 1, 0, 1], [0, 0, 1, 2], [0, 1, 2, 3]]
    # Boundaries: every sample start (0, 4, 8, 12), after each EOD inside a row (2; 5; none), the end.
    assert full["cu_seqlens"].tolist() == [0, 2, 4, 5, 8, 12]
    assert full["max_seqlen"] == 4


def test_get_batch_reads_the_indexed_samples(corpus, tmp_path):
    indexed, _ = corpus
    ds = _dataset(indexed, tmp_path, 20)
    batch = ds.get_batch([3, 7])
    assert batch["tokens"].shape == (2, SEQ)
    assert batch["tokens"][1].tolist() == ds.sample(7)[:-1].tolist()
    assert batch["labels"][1].tolist() == ds.sample(7)[1:].tolist()
    with pytest.raises(IndexError, match=r"sample 20 out of range \(20 samples\)"):
        ds.get_batch([20])


def test_bad_ranges_and_empty_splits_are_rejected_on_every_rank(corpus, tmp_path):
    indexed, _ = corpus
    with pytest.raises(ValueError, match=r"range \[50, 50\) is empty"):
        _dataset(indexed, tmp_path, 5, document_range=(50, 50))
    with pytest.raises(ValueError, match=r"documents \[0, 1\) hold no tokens"):
        _dataset(indexed, tmp_path, 5, document_range=(0, 1), is_builder=False)
    # A negative start would slice from the end of the file.
    with pytest.raises(ValueError, match=r"range \[-1, 5\) is empty or outside"):
        _dataset(indexed, tmp_path, 5, document_range=(-1, 5))


def test_sample_numbers_outside_the_dataset_are_refused(corpus, tmp_path):
    indexed, _ = corpus
    dataset = _dataset(indexed, tmp_path, 5)
    assert dataset.sample(0).shape == dataset.sample(4).shape == (SEQ + 1,)
    for index in (-1, 5):  # -1 would read the last sample
        with pytest.raises(IndexError, match=f"sample {index} out of range"):
            dataset.sample(index)


def test_unwritable_cache_names_the_flag(corpus, tmp_path):
    indexed, _ = corpus
    (tmp_path / "file").write_text("")
    cache = IndexCache(str(tmp_path / "file" / "cache"))
    with pytest.raises(OSError, match=r"cannot write the data index cache in .*file/cache \(Not a directory\); "
                                      r"choose a writable directory with --data-cache-path"):
        GPTDataset(indexed, SPLIT, 5, seq_length=SEQ, seed=0, options=BatchOptions(eod=-1), cache=cache,
                   split_name="train")


def test_sample_index_refuses_a_split_without_tokens_and_takes_a_one_token_one():
    with pytest.raises(ValueError, match="the split has no tokens"):
        build_sample_index(np.array([0, 0]), num_samples=2, seq_length=4, seed=0)
    # One token per epoch: 3 samples of 2 tokens (+1 for the last label) need 7 epochs of the document.
    index = build_sample_index(np.array([1]), num_samples=3, seq_length=2, seed=0)
    assert len(index["document_index"]) == 7 and len(index["sample_index"]) == 3 + 1


def test_one_sample_is_a_dataset_and_zero_is_refused(corpus, tmp_path):
    # The smallest request (one sample: a single eval batch, a one-iteration run) builds; zero names itself.
    indexed, documents = corpus
    one = _dataset(indexed, tmp_path, 1)
    assert len(one) == 1 and one.sample(0).shape == (SEQ + 1,)
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        _dataset(indexed, tmp_path, 0)


def test_one_token_samples_are_the_smallest_length_and_zero_is_refused():
    # seq_length 1 is the boundary of the check: every sample is one input token and its label, so
    # sample i starts at token i of the stream and the index walks each document token by token.
    index = build_sample_index(np.array([5]), num_samples=4, seq_length=1, seed=0)
    assert index["document_index"].tolist() == [0]
    assert index["sample_index"].tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [0, 4]]
    assert sorted(index["shuffle_index"].tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="seq_length >= 1, got 4 and 0"):
        build_sample_index(np.array([5]), num_samples=4, seq_length=0, seed=0)


def test_batches_are_int64_whatever_the_token_dtype():
    # A .bin stores uint16 or int32 token ids; the embedding takes int64.
    for samples in (np.array([[5, 6, 0, 7]], dtype=np.uint16), np.array([[5, 6, 0, 7]], dtype=np.int32),
                    [[5, 6, 0, 7]]):
        batch = make_batch(samples, BatchOptions(eod=0))
        assert batch["tokens"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
        assert batch["tokens"].tolist() == [[5, 6, 0]] and batch["labels"].tolist() == [[6, 0, 7]]


def test_sample_index_refuses_zero_samples():
    with pytest.raises(ValueError, match="need num_samples >= 1 and seq_length >= 1, got 0 and 4"):
        build_sample_index(np.array([5]), num_samples=0, seq_length=4, seed=0)


def test_cache_files_follow_the_umask_and_a_failed_write_leaves_nothing(corpus, tmp_path):
    # The cache is shared by every job on the cluster: its files get the mode a plain open() gives them
    # (tempfile makes 0600), and a write that fails leaves no temporary file behind.
    indexed, _ = corpus
    old = os.umask(0o027)
    try:
        _dataset(indexed, tmp_path, 40)
    finally:
        os.umask(old)
    files = os.listdir(tmp_path / "cache")
    assert files and all(os.stat(tmp_path / "cache" / f).st_mode & 0o777 == 0o640 for f in files)

    def fail(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        gpt_dataset._atomic_write(str(tmp_path / "cache" / "x.npy"), fail)
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(files)


def test_a_one_sample_batch_hands_torch_only_writable_arrays(monkeypatch):
    # At micro-batch 1 a broadcast position array is read-only, and torch warns (once per process, so
    # the check is on what make_batch hands it).
    from_numpy = torch.from_numpy

    def writable_only(array):
        assert array.flags.writeable
        return from_numpy(array)

    monkeypatch.setattr(torch, "from_numpy", writable_only)
    for options in (BatchOptions(eod=0), BatchOptions(eod=0, reset_position_ids=True, reset_attention_mask=True)):
        batch = make_batch(np.array([[5, 6, 0, 7]]), options)
    assert batch["position_ids"].tolist() == [[0, 1, 2]]


def test_document_ids_are_int32_exactly_while_they_fit():
    from megatron_pp.data.gpt_dataset import document_id_dtype
    assert document_id_dtype(1) is np.int32 and document_id_dtype(2**31) is np.int32  # ids up to 2^31 - 1
    assert document_id_dtype(2**31 + 1) is np.int64 and document_id_dtype(2**33) is np.int64
    # Lengths given as a list or as the .idx's int32 give the same index as int64 ones.
    expected = build_sample_index(np.array([5, 3, 7], dtype=np.int64), num_samples=6, seq_length=4, seed=1)
    for lengths in ([5, 3, 7], np.array([5, 3, 7], dtype=np.int32)):
        got = build_sample_index(lengths, num_samples=6, seq_length=4, seed=1)
        assert all(np.array_equal(got[k], expected[k]) for k in expected)
    assert expected["document_index"].dtype == np.int32
