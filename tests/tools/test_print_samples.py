"""tools/print_samples.py: the first N samples a job reads, in its order, one JSON list a line; bad flags in
one line with exit status 2."""
from __future__ import annotations

import json
import os
import sys

import pytest

from megatron_pp.data.builder import DataConfig, build_datasets, split_sample_counts
from tests.data import write_numbered_dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
import print_samples  # noqa: E402


@pytest.fixture
def corpus(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_numbered_dataset(a, [(7 * i) % 29 + 1 for i in range(60)])
    write_numbered_dataset(b, [(5 * i) % 13 + 3 for i in range(40)], first=100_000)
    return a, b


def test_writes_the_samples_the_job_reads_in_order(corpus, tmp_path):
    a, b = corpus
    out = str(tmp_path / "samples.jsonl")
    job = ["--data-path", "0.3", a, "0.7", b, "--split", "90,8,2", "--seq-length", "8", "--seed", "3",
           "--train-iters", "20", "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-interval", "5",
           "--eval-iters", "2", "--num-layers", "2", "--data-cache-path", str(tmp_path / "cache")]
    assert print_samples.main(job + ["--num-samples", "30", "--json", out]) == 0
    rows = [json.loads(line) for line in open(out)]
    config = DataConfig(seq_length=8, seed=3, data_path=["0.3", a, "0.7", b], split="90,8,2",
                        cache_dir=str(tmp_path / "cache"))
    train, valid, _ = build_datasets(config, split_sample_counts(160, 8, 2, 5, 20), eod_id=0)
    assert len(rows) == 30 and all(len(row) == 9 for row in rows)
    assert rows == [train.sample(i).tolist() for i in range(30)]
    assert {row[0] >= 100_000 for row in rows} == {True, False}  # both datasets feed the blend
    assert print_samples.main(job + ["--num-samples", "4", "--first-sample", "16", "--split-name", "valid",
                                     "--json", out]) == 0
    assert [json.loads(line) for line in open(out)] == [valid.sample(i).tolist() for i in range(16, 20)]


def test_a_batch_size_ramp_up_sets_the_validation_count_as_the_job_counts_it(corpus, tmp_path):
    """--rampup-batch-size 2 2 8 with a global batch of 8 and 160 samples: the ramp's 4 iterations (2, 2, 4, 8)
    consume 16 samples, then 18 full ones: 22 iterations, not 160 // 8 = 20, so the job asks the validation
    split for (22 // 7 + 1) x 2 x 8 = 64 samples, not 48, and the validation order follows that count."""
    a, _ = corpus
    out = str(tmp_path / "valid.jsonl")
    job = ["--data-path", a, "--split", "90,8,2", "--seq-length", "8", "--seed", "3", "--train-samples", "160",
           "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "8", "--eval-interval", "7",
           "--eval-iters", "2", "--data-cache-path", str(tmp_path / "cache")]
    assert print_samples.main(job + ["--num-samples", "12", "--split-name", "valid", "--json", out]) == 0
    config = DataConfig(seq_length=8, seed=3, data_path=[a], split="90,8,2", cache_dir=str(tmp_path / "cache"))
    assert split_sample_counts(160, 8, 2, 7, 22)[1] == 64
    ramp = build_datasets(config, split_sample_counts(160, 8, 2, 7, 22), eod_id=0)[1]
    constant = build_datasets(config, split_sample_counts(160, 8, 2, 7, 20), eod_id=0)[1]
    rows = [json.loads(line) for line in open(out)]
    assert rows == [ramp.sample(i).tolist() for i in range(12)]
    assert rows != [constant.sample(i).tolist() for i in range(12)]


@pytest.mark.parametrize("flags, message", [
    (["--data-path", "0", "A", "0", "B"], "--data-path: the weights sum to 0"),
    (["--data-path", "B", "--split", "99,1,0", "--eval-interval", "5"], "leaves"),  # validation: [40, 40)
    (["--data-path", "A", "--data-order", "shuffled"], "--data-order"),
])
def test_bad_flags_are_one_line_and_exit_2(corpus, tmp_path, capsys, flags, message):
    a, b = corpus
    flags = [a if f == "A" else b if f == "B" else f for f in flags]
    base = ["--seq-length", "8", "--train-iters", "4", "--global-batch-size", "4", "--num-samples", "2",
            "--json", str(tmp_path / "x.jsonl"), "--data-cache-path", str(tmp_path / "cache")]
    try:
        status = print_samples.main(flags + base)
    except SystemExit as exc:  # argparse's own checks (choices) exit from inside parse_args
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not os.path.exists(tmp_path / "x.jsonl")


def test_a_split_the_job_never_reads_does_not_stop_it(corpus, tmp_path):
    """--split 969,30,1 of B's 40 sequences leaves the test split empty; the job never reads a test split and
    runs, so its training samples print; asked for that split, print_samples says it is empty (exit 2)."""
    _, b = corpus
    out = str(tmp_path / "train.jsonl")
    job = ["--data-path", b, "--split", "969,30,1", "--seq-length", "8", "--seed", "3", "--train-iters", "4",
           "--global-batch-size", "4", "--eval-interval", "5", "--data-cache-path", str(tmp_path / "cache")]
    assert print_samples.main(job + ["--num-samples", "3", "--json", out]) == 0
    config = DataConfig(seq_length=8, seed=3, data_path=[b], split="969,30,1", cache_dir=str(tmp_path / "cache"))
    train = build_datasets(config, (16, 0, 0), eod_id=0)[0]  # the training order depends on its own count only
    assert [json.loads(line) for line in open(out)] == [train.sample(i).tolist() for i in range(3)]
    assert print_samples.main(job + ["--num-samples", "1", "--split-name", "test", "--json", out]) == 2
