"""`--data-order megatron` against megatron-core itself: its GPTDataset / BlendedDataset built on the same
.bin/.idx files, compared token for token (single dataset over several epochs with and without a separate
last epoch, valid and test splits, weighted and unweighted blends, the batch layout at dp 1 and 2, a resume
mid-epoch), and its cache directory read when it matches, refused in one line when it does not."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from megatron_pp.data import megatron_order
from megatron_pp.data.builder import DataConfig, build_datasets, split_sample_counts
from megatron_pp.data.gpt_dataset import DataFlagError
from megatron_pp.data.megatron_cache import CacheMismatch
from megatron_pp.training.step_data import TrainingData
from tests.data import write_numbered_dataset

SEQ = 8
SEED = 7
# 60 sequences of 1..29 tokens (one empty): about 900 tokens, ~110 samples an epoch.
LENGTHS_A = [(7 * i) % 29 + 1 - (i == 33) for i in range(60)]
LENGTHS_B = [(5 * i) % 13 + 3 for i in range(40)]


class _Tokenizer:
    """What megatron-core's GPTDatasetConfig reads of a tokenizer."""

    vocab_size = 100_000
    eod = 0
    pad = -1
    unique_identifiers = {"class": "TestTokenizer"}


@pytest.fixture(scope="module")
def mcore():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    assert not torch.distributed.is_initialized()

    def build(sizes, cache, **blend):
        config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, tokenizer=_Tokenizer(),
                                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                  path_to_cache=cache, **blend)
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return build


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    a, b = str(root / "a"), str(root / "b")
    write_numbered_dataset(a, LENGTHS_A)
    write_numbered_dataset(b, LENGTHS_B, first=100_000)
    return a, b


def _theirs(dataset, i: int) -> np.ndarray:
    """Megatron-core's sample i as seq_length + 1 token ids."""
    item = dataset[i]
    return torch.cat([item["tokens"], item["labels"][-1:]]).numpy().astype(np.int64)


def _assert_same(ours, theirs, count: int, first: int = 0) -> None:
    for i in range(first, first + count):
        np.testing.assert_array_equal(ours.sample(i), _theirs(theirs, i), err_msg=f"sample {i}")


def _ours(tmp_path, sizes, **config):
    config = DataConfig(seq_length=SEQ, seed=SEED, cache_dir=str(tmp_path / "ours"), **config)
    return build_datasets(config, sizes, eod_id=0)


def test_one_dataset_over_epochs_and_its_valid_and_test_splits(mcore, corpus, tmp_path):
    a, _ = corpus
    # train: 270 samples need 3 epochs of 102; the third supplies 66 < int(0.8 · 102): shuffled apart.
    # valid: 30 samples of a 51-token split (6 an epoch) need 5 epochs, the last full enough to join.
    sizes = (270, 30, 12)
    theirs = mcore(list(sizes), str(tmp_path / "mcore"), blend=([a], None), split="90,8,2")
    ours = _ours(tmp_path, sizes, data_path=[a], split="90,8,2")
    for split, mine, reference in zip(("train", "valid", "test"), ours, theirs):
        assert len(mine) == len(reference), split
        _assert_same(mine, reference, len(reference))
        for name in ("document_index", "sample_index", "shuffle_index"):
            np.testing.assert_array_equal(getattr(mine, name), getattr(reference, name), err_msg=f"{split} {name}")
    assert _separate_last_epoch(sum(LENGTHS_A[:54]), 270) and not _separate_last_epoch(sum(LENGTHS_A[54:59]), 30)


def _separate_last_epoch(tokens: int, num_samples: int) -> bool:
    epochs = megatron_order.num_epochs(tokens, num_samples, SEQ)
    before_last = ((epochs - 1) * tokens - 1) // SEQ
    return epochs > 1 and num_samples - before_last < int(0.8 * ((tokens - 1) // SEQ))


def test_blends_weighted_and_unweighted(mcore, corpus, tmp_path):
    a, b = corpus
    sizes = (150, 20, 0)
    # No cache for megatron-core's blends: its BlendedDataset asks torch.distributed for the rank when it caches.
    theirs = mcore([150, 20, 0], None, blend=([a, b], [0.3, 0.7]), split="95,5,0")
    ours = _ours(tmp_path, sizes, data_path=["0.3", a, "0.7", b], split="95,5,0")
    for mine, reference in zip(ours[:2], theirs[:2]):
        assert len(mine) == len(reference)
        np.testing.assert_array_equal(mine.dataset_index, reference.dataset_index)
        _assert_same(mine, reference, len(reference))
    assert ours[2] is None and theirs[2] is None
    theirs = mcore([100, 0, 0], None, blend=([a, b], None), split="1")
    ours = _ours(tmp_path, (100, 0, 0), data_path=[a, b], split="1")
    _assert_same(ours[0], theirs[0], 100)


def _megatron_sampler(consumed: int, total: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """Megatron-LM's pretraining sampler as described: sequential from `consumed`, each slice of
    micro_batch_size · dp_size samples cut so that rank r takes [r·mbs, (r + 1)·mbs)."""
    batch = []
    for index in range(consumed, total):
        batch.append(index)
        if len(batch) == micro_batch_size * dp_size:
            yield batch[dp_rank * micro_batch_size : (dp_rank + 1) * micro_batch_size]
            batch = []


@pytest.mark.parametrize("dp_size", [1, 2])
def test_global_batches_at_dp_1_and_2_and_a_resume_mid_epoch(mcore, corpus, tmp_path, dp_size):
    a, _ = corpus
    micro, global_batch, iters = 2, 8, 30  # 240 samples: the second epoch starts in iteration 13
    theirs = mcore([iters * global_batch, 8, 8], str(tmp_path / "mcore"), blend=([a], None), split="90,8,2")[0]
    consumed = 13 * global_batch  # a checkpoint taken mid second epoch
    for resumed in (False, True):
        train = _ours(tmp_path, (iters * global_batch, 8, 8), data_path=[a], split="90,8,2")[0]  # resumed: from cache
        data = TrainingData(train, None, micro, global_batch, dp_size)
        for iteration in range(13 if resumed else 0, 16 if resumed else 4):
            for rank in range(dp_size):
                reference = _megatron_sampler(iteration * global_batch, len(theirs), micro, rank, dp_size)
                expected = [np.stack([_theirs(theirs, i) for i in next(reference)])
                            for _ in range(data.num_microbatches)]
                got = data.microbatches(train, iteration * global_batch, rank, torch.device("cpu"))
                for want, batch in zip(expected, got):
                    np.testing.assert_array_equal(batch["tokens"].numpy(), want[:, :-1])
                    np.testing.assert_array_equal(batch["labels"].numpy(), want[:, 1:])
    assert consumed < len(theirs)


def test_megatron_cache_directory_is_read_when_it_matches_and_refused_when_it_does_not(mcore, corpus, tmp_path):
    a, _ = corpus
    shared = str(tmp_path / "shared-cache")
    theirs = mcore([120, 10, 4], shared, blend=([a], None), split="90,8,2")[0]
    config = DataConfig(seq_length=SEQ, seed=SEED, data_path=[a], split="90,8,2", cache_dir=shared)
    train = build_datasets(config, (120, 10, 4), eod_id=0)[0]
    assert os.path.dirname(train.shuffle_index.filename) == shared
    assert "GPTDataset-train-shuffle_index" in os.path.basename(train.shuffle_index.filename)
    _assert_same(train, theirs, 120)
    # Other flags (another seed): Megatron-LM's files are not for them; ours are built beside them.
    other = build_datasets(DataConfig(**{**config.__dict__, "seed": SEED + 1}), (120, 10, 4), eod_id=0)[0]
    assert "GPTDataset" not in os.path.basename(other.shuffle_index.filename)
    # A Megatron-LM file that claims these flags but holds another order: one line naming it, exit status 2.
    path = train.shuffle_index.filename
    tampered = np.array(np.load(path))[::-1].copy()
    np.save(path, tampered)
    with pytest.raises(CacheMismatch, match=r"shuffle_index\.npy: Megatron-LM's cached shuffle_index") as error:
        build_datasets(config, (120, 10, 4), eod_id=0)
    assert error.value.exit_status == 2 and "\n" not in str(error.value)


def test_bad_splits_are_named_in_one_line(corpus, tmp_path):
    a, b = corpus
    # 969,30,1 of 40 sequences: round(.999 · 40) = 40, so the test split is empty (megatron-core would loop
    # forever looking for an epoch's tokens).
    with pytest.raises(DataFlagError, match=r"--data-path: --split 969,30,1 leaves .*b 0 sequences for its test"):
        _ours(tmp_path, (10, 4, 2), data_path=[b], split="969,30,1")
    assert _ours(tmp_path, (10, 4, 0), data_path=[b], split="969,30,1")[2] is None  # not needed: not built
    with pytest.raises(DataFlagError, match="unweighted datasets give one epoch each"):
        _ours(tmp_path, (10_000, 0, 0), data_path=[a, b], split="1")


def test_split_bounds_and_counts_follow_megatron():
    assert megatron_order.split_bounds("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert megatron_order.split_bounds("98,2", 10) == [(0, 10), (10, 10), None]
    assert split_sample_counts(1600, 16, 5, 40, 100) == (1600, 240, 80)
    assert split_sample_counts(1600, 16, 5, None, 100) == (1600, 0, 0)
    # Greedy blend, weights 0.25 / 0.75 (the module doc's example).
    assert megatron_order.blending_indices([0.25, 0.75], 8)[0].tolist() == [1, 0, 1, 1, 0, 1, 1, 1]
    assert megatron_order.blend_sizes([3, 7], 1000) == ([300, 700], [302, 704])


def test_our_cache_file_made_for_other_flags_is_refused(corpus, tmp_path):
    a, _ = corpus
    config = DataConfig(seq_length=SEQ, seed=SEED, data_path=[a], split="90,8,2", cache_dir=str(tmp_path / "c"))
    build_datasets(config, (50, 0, 0), eod_id=0)
    (description,) = [p for p in (tmp_path / "c").iterdir() if p.suffix == ".json"]
    description.write_text(description.read_text().replace('"seed": 7', '"seed": 8'))
    with pytest.raises(CacheMismatch, match=r"\.json: this cached data index was made for other flags") as error:
        build_datasets(config, (50, 0, 0), eod_id=0)
    assert error.value.exit_status == 2
    other = DataConfig(**{**config.__dict__, "data_order": "epoch-exact"})  # another order: another key
    assert len(build_datasets(other, (50, 0, 0), eod_id=0)[0]) == 50


def _mcore_blend_with_cache(ctx, a, b, cache):
    """megatron-core's weighted blend built with a cache directory (its BlendedDataset asks torch.distributed
    for the rank before it writes, so it runs in a one-rank gloo worker): the train split's samples."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, tokenizer=_Tokenizer(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, path_to_cache=cache,
                              blend=([a, b], [0.3, 0.7]), split="95,5,0")
    train = BlendedMegatronDatasetBuilder(GPTDataset, [150, 20, 0], lambda: True, config).build()[0]
    return [_theirs(train, i) for i in range(len(train))]


def test_megatron_blend_cache_directory_is_read_when_it_matches_and_refused_when_it_does_not(corpus, tmp_path):
    from megatron_pp.core.local_world import WorkerPool

    a, b = corpus
    shared = str(tmp_path / "shared-cache")
    pool = WorkerPool(1)
    try:
        theirs = pool.run(_mcore_blend_with_cache, a, b, shared, timeout=600)[0]
    finally:
        pool.close()
    written = sorted(os.listdir(shared))
    assert any("-BlendedDataset-train-dataset_index.npy" in n for n in written)
    assert any("-GPTDataset-train-shuffle_index.npy" in n for n in written)
    config = DataConfig(seq_length=SEQ, seed=SEED, data_path=["0.3", a, "0.7", b], split="95,5,0", cache_dir=shared)
    train = build_datasets(config, (150, 20, 0), eod_id=0)[0]
    # Megatron-LM's files are what the run reads: the blend's indices and each member's shuffle index.
    assert "-BlendedDataset-train-dataset_index" in os.path.basename(train.dataset_index.filename)
    assert "-BlendedDataset-train-dataset_sample_index" in os.path.basename(train.dataset_sample_index.filename)
    for member in train.datasets:
        assert "-GPTDataset-train-shuffle_index" in os.path.basename(member.shuffle_index.filename)
    assert len(train) == len(theirs)
    for i, want in enumerate(theirs):
        np.testing.assert_array_equal(train.sample(i), want, err_msg=f"sample {i}")
    # Our own files are there too (the comparison needs them), keyed by content.
    assert len(os.listdir(shared)) > len(written)
    # Another seed: the members' Megatron-LM files are not for it, ours are built beside them and read; the
    # blend's own indices use no random numbers, so Megatron-LM's (equal to ours: compared) are still read.
    other = build_datasets(DataConfig(**{**config.__dict__, "seed": SEED + 1}), (150, 20, 0), eod_id=0)[0]
    for member in other.datasets:
        assert "GPTDataset" not in os.path.basename(member.shuffle_index.filename)
    assert "BlendedDataset" in os.path.basename(other.dataset_index.filename)
    # A Megatron-LM blend file that claims these flags but holds another blend: one line naming it, exit 2.
    path = train.dataset_index.filename
    np.save(path, np.array(np.load(path))[::-1].copy())
    with pytest.raises(CacheMismatch, match=r"dataset_index\.npy: Megatron-LM's cached dataset_index") as error:
        build_datasets(config, (150, 20, 0), eod_id=0)
    assert error.value.exit_status == 2 and "\n" not in str(error.value)
