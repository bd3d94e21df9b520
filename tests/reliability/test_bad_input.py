"""Bad input through the real entry point (`train.main`, what pretrain_gpt.py runs): every case ends with
one `error:` line on stderr naming the flag or file, a non-zero exit (2: arguments and config files,
1: files found wrong at startup), no traceback, and no output file written. Flag-only combinations
that validation rejects are also listed (and unit-tested) in tests/training/test_arguments.py; this
table covers the kinds of input end to end, plus the multi-rank schedule cases in separate processes.

Fuzzing (hypothesis, fixed examples): the argument parser and the `.idx` reader either accept their
input or fail with the project's one-line error, never with another exception."""
from __future__ import annotations

import os
import pickle
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_pp.data.indexed import HEADER_SIZE, IndexedDataset, IndexFormatError, write_dataset
from megatron_pp.training.arguments import parse_args
from megatron_pp.training.checkpointing import TRACKER_FILE
from megatron_pp.training.train import main, pretrain
from tests.reliability.ranks import launch_ranks, stderr_of, wait_all

TINY = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--seed", "3",
        "--train-iters", "2"]
MOCK = TINY + ["--mock-data"]
FILE = TINY + ["--data-path", "{fx}/corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
               "--split", "100,0,0"]


class Pickled:
    """Unpickling this runs os.system: a checkpoint shard must never be able to do that."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """Shared inputs: a valid corpus, damaged copies, a bad tokenizer and a one-step checkpoint."""
    d = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 300, rng.integers(20, 60)), 300) for _ in range(30)]
    write_dataset(str(d / "corpus"), docs, np.uint16)
    write_dataset(str(d / "wide"), [np.full(100, 450) for _ in range(10)], np.uint16)  # ids beyond vocab 301
    idx = (d / "corpus.idx").read_bytes()
    for name, idx_bytes in {"badmagic": b"NOTANIDX!" + idx[9:], "truncidx": idx[:-5],
                            "badversion": idx[:9] + struct.pack("<Q", 7) + idx[17:],
                            "floatdtype": idx[:17] + bytes([6]) + idx[18:]}.items():
        (d / f"{name}.idx").write_bytes(idx_bytes)
        shutil.copy(d / "corpus.bin", d / f"{name}.bin")
    (d / "shortbin.idx").write_bytes(idx)
    (d / "shortbin.bin").write_bytes((d / "corpus.bin").read_bytes()[:-10])
    shutil.copy(d / "corpus.idx", d / "nobin.idx")
    shutil.copy(d / "corpus.bin", d / "noidx.bin")
    (d / "tokenizer.json").write_text("{this is not json")
    pretrain(parse_args(MOCK + ["--train-iters", "1", "--save", str(d / "ck")]))
    return d


def _damage(fx, tmp, how):
    """A copy of the fixture checkpoint, damaged as `how` says; returns its path."""
    ck = tmp / "ck"
    shutil.copytree(fx / "ck", ck)
    it = ck / "iter_0000001"
    if how == "tracker_target":
        (ck / TRACKER_FILE).write_text("7\n")
    elif how == "no_metadata":  # a save that died before publishing, with the tracker forced onto it
        (it / "metadata.json").unlink()
    elif how == "garbage_tracker":
        (ck / TRACKER_FILE).write_text("latest\n")
    elif how == "truncated_shard":
        shard = it / "model_stage000_tp00.pt"
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "missing_shard":
        (it / "optim_pp000_tp00_dp000.pt").unlink()
    elif how == "pickle":
        with open(it / "model_stage000_tp00.pt", "wb") as f:
            pickle.dump({"model": Pickled(str(tmp / "pwned"))}, f)
    elif how == "bad_json":
        (it / "metadata.json").write_text("{")
    return ck


# (id, argv, what the error line must contain, exit status, checkpoint damage or None, extra env)
CASES = [
    # Flags: parsing -----------------------------------------------------------------------------------
    ("unknown-flag", MOCK + ["--learning-rate", "1"], "unrecognized arguments: --learning-rate", 2, None, {}),
    ("not-an-int", MOCK + ["--micro-batch-size", "two"], "--micro-batch-size: invalid int value", 2, None, {}),
    ("bad-choice", MOCK + ["--lr-decay-style", "stepwise"], "--lr-decay-style: invalid choice", 2, None, {}),
    ("missing-value", MOCK + ["--seed"], "--seed: expected one argument", 2, None, {}),
    # Flags: sizes and combinations ----------------------------------------------------------------------
    ("tp-zero", MOCK + ["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1", 2, None, {}),
    ("world-not-divisible", MOCK + ["--pipeline-model-parallel-size", "3"], "world size 4 is not divisible", 2, None,
     {"WORLD_SIZE": "4"}),
    ("heads-vs-tp", MOCK + ["--tensor-model-parallel-size", "8"], "is not divisible by --tensor-model-parallel-size",
     2, None, {"WORLD_SIZE": "8"}),
    ("layers-vs-pp", MOCK + ["--pipeline-model-parallel-size", "3"], "--num-layers 4 is not divisible by 3", 2, None,
     {"WORLD_SIZE": "3"}),
    ("batch-not-divisible", MOCK + ["--global-batch-size", "5"], "--global-batch-size 5 is not divisible", 2, None, {}),
    ("bf16-and-fp16", MOCK + ["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive", 2, None, {}),
    ("no-length", ["--model-preset", "gpt-tiny", "--mock-data"], "exactly one of --train-iters and --train-samples",
     2, None, {}),
    ("save-is-a-file", MOCK + ["--save", "{fx}/corpus.bin"], "is a file, not a directory", 2, None, {}),
    ("metrics-dir-missing", MOCK + ["--metrics-file", "{tmp}/nowhere/m.jsonl"], "--metrics-file", 2, None, {}),
    ("nonfinite-limit", MOCK + ["--max-consecutive-nonfinite", "0"], "--max-consecutive-nonfinite must be >= 1", 2,
     None, {}),
    ("spike-factor", MOCK + ["--loss-spike-factor", "0.5"], "--loss-spike-factor must be > 1", 2, None, {}),
    ("pg-timeout", MOCK + ["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0", 2,
     None, {}),
    ("save-failure-needs-save", MOCK + ["--continue-on-save-failure"], "--continue-on-save-failure needs --save", 2,
     None, {}),
    # Schedules -----------------------------------------------------------------------------------------
    ("unknown-schedule", MOCK + ["--pipeline-schedule", "zigzag"], "unknown --pipeline-schedule 'zigzag'", 2, None, {}),
    ("offload-with-gpipe", MOCK + ["--pipeline-schedule", "gpipe", "--offload-chunks", "1"],
     "--offload-chunks does not apply to --pipeline-schedule gpipe", 2, None, {}),
    ("option-of-other-schedule", MOCK + ["--microbatch-group-size-per-vp-stage", "2"],
     "--microbatch-group-size-per-vp-stage does not apply to --pipeline-schedule 1f1b", 2, None, {}),
    ("vp-does-not-divide", MOCK + ["--num-layers-per-virtual-pipeline-stage", "3"],
     "--num-layers-per-virtual-pipeline-stage 3", 2, None, {}),
    ("chunks-without-virtual", MOCK + ["--num-virtual-stages-per-pipeline-rank", "2"],
     "has no virtual stages", 2, None, {}),  # the schedule is built by the argument checks: a usage error
    # Config files ------------------------------------------------------------------------------------
    ("yaml-unknown-key", ["--config", "{tmp}/run.yaml"], "unknown key 'learning_rate'", 2, "learning_rate: 0.1\n", {}),
    ("yaml-not-mapping", ["--config", "{tmp}/run.yaml"], "expected a mapping", 2, "- lr\n", {}),
    ("yaml-invalid", ["--config", "{tmp}/run.yaml"], "not valid YAML", 2, "lr: [1\n", {}),
    ("yaml-missing", ["--config", "{tmp}/absent.yaml"], "--config {tmp}/absent.yaml: No such file", 2, None, {}),
    ("yaml-absolute-save", MOCK + ["--config", "{tmp}/run.yaml"], "points outside the run directory", 2,
     "save: /tmp/elsewhere\n", {}),
    ("yaml-dotdot-output", MOCK + ["--config", "{tmp}/run.yaml"], "metrics-file '../m.jsonl' points outside", 2,
     "metrics-file: ../m.jsonl\n", {}),
    # Data files -----------------------------------------------------------------------------------------
    ("bin-missing", FILE[:-7] + ["--data-path", "{fx}/nobin", *FILE[-6:]], "{fx}/nobin.bin", 2, None, {}),
    ("idx-missing", FILE[:-7] + ["--data-path", "{fx}/noidx", *FILE[-6:]], "{fx}/noidx.idx", 2, None, {}),
    ("idx-bad-magic", FILE[:-7] + ["--data-path", "{fx}/badmagic", *FILE[-6:]], "badmagic.idx: not an indexed", 1,
     None, {}),
    ("idx-truncated", FILE[:-7] + ["--data-path", "{fx}/truncidx", *FILE[-6:]], "truncidx.idx: truncated", 1, None, {}),
    ("idx-version", FILE[:-7] + ["--data-path", "{fx}/badversion", *FILE[-6:]], "unsupported format version 7", 1,
     None, {}),
    ("idx-float-dtype", FILE[:-7] + ["--data-path", "{fx}/floatdtype", *FILE[-6:]], "dtype code 6", 1, None, {}),
    ("bin-truncated", FILE[:-7] + ["--data-path", "{fx}/shortbin", *FILE[-6:]], "shortbin", 1, None, {}),
    ("bad-split", FILE + ["--split", "90,x"], "--split '90,x'", 2, None, {}),
    # Tokenizers -----------------------------------------------------------------------------------------
    ("tokenizer-unreadable", FILE[:-6] + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                          "{fx}/tokenizer.json", "--split", "100,0,0"],
     "tokenizer.json is not a readable tokenizer.json", 1, None, {}),
    ("tokenizer-missing", FILE[:-6] + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                       "{fx}/absent.json", "--split", "100,0,0"], "{fx}/absent.json", 2, None, {}),
    ("ids-beyond-vocabulary", FILE[:-7] + ["--data-path", "{fx}/wide", *FILE[-6:]],
     "token id 450, outside the tokenizer's vocabulary 0..300", 1, None, {}),
    # Checkpoints ----------------------------------------------------------------------------------------
    ("ckpt-other-shape", MOCK + ["--load", "{tmp}/ck", "--hidden-size", "128"], "holds a different model", 1, "-", {}),
    ("ckpt-other-split", MOCK + ["--load", "{tmp}/ck", "--pipeline-schedule", "interleaved-1f1b",
                                 "--num-virtual-stages-per-pipeline-rank", "2"], "conversion tool", 1, "-", {}),
    ("ckpt-tracker-target-missing", MOCK + ["--load", "{tmp}/ck"], "names iteration 7, but", 1, "tracker_target", {}),
    ("ckpt-half-written", MOCK + ["--load", "{tmp}/ck"], "metadata.json: missing", 1, "no_metadata", {}),
    ("ckpt-garbage-tracker", MOCK + ["--load", "{tmp}/ck"], "expected an iteration number", 1, "garbage_tracker", {}),
    ("ckpt-truncated-shard", MOCK + ["--load", "{tmp}/ck"], "model_stage000_tp00.pt: unreadable", 1, "truncated_shard",
     {}),
    ("ckpt-missing-shard", MOCK + ["--load", "{tmp}/ck"], "optim_pp000_tp00_dp000.pt: missing", 1, "missing_shard", {}),
    ("ckpt-pickle-code", MOCK + ["--load", "{tmp}/ck"], "model_stage000_tp00.pt: refused to load", 1, "pickle", {}),
    ("ckpt-bad-metadata", MOCK + ["--load", "{tmp}/ck"], "not valid JSON", 1, "bad_json", {}),
    ("ckpt-none-but-required", MOCK + ["--load", "{tmp}/empty", "--exit-on-missing-checkpoint"],
     "no checkpoint found", 1, None, {}),
]


@pytest.mark.parametrize("name,argv,needle,status,damage,env", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(fx, tmp_path, capsys, monkeypatch, name, argv, needle, status,
                                                   damage, env):
    out = tmp_path / "out"
    out.mkdir()
    if isinstance(damage, str) and name.startswith("yaml"):
        (tmp_path / "run.yaml").write_text(damage)
    elif damage is not None:
        _damage(fx, tmp_path, damage)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if env:
        monkeypatch.setenv("RANK", "0")
    argv = [a.format(fx=fx, tmp=tmp_path) for a in argv]
    if "--metrics-file" not in argv and not name.startswith("yaml"):
        argv += ["--metrics-file", str(out / "metrics.jsonl")]
    if "--save" not in argv and "--config" not in argv and "--continue-on-save-failure" not in argv:
        argv += ["--save", str(out / "ck"), "--save-interval", "1"]
    capsys.readouterr()
    # A world pretended through RANK / WORLD_SIZE has no other ranks to meet: check the arguments alone.
    with pytest.raises(SystemExit) as info:
        (parse_args if env else main)(argv)
    err = capsys.readouterr().err
    assert info.value.code == status, err
    lines = err.splitlines()
    # One line per problem: validation reports every problem at once (a case may break two rules).
    assert lines and all(line.startswith("error: ") for line in lines), err
    assert len(lines) == 1 or status == 2, err
    assert any(needle.format(fx=fx, tmp=tmp_path) in line for line in lines), lines
    assert "Traceback" not in err
    assert os.listdir(out) == [], os.listdir(out)
    assert not (tmp_path / "pwned").exists()  # the pickle's code never ran


# Schedules that need several ranks: the sizes only conflict once the world is known. The argument checks
# build the schedule for the launched world, so every rank refuses before any process group (exit 2),
# and the job prints the line once (training/errors.py). Separate processes, as srun starts them.
@pytest.mark.parametrize("schedule,needle", [("2bw", "m >= p"), ("looped-bfs", "microbatches per breadth-first")],
                         ids=["2bw-m<p", "looped-bfs-m<p"])
def test_schedule_needing_more_microbatches_fails_on_every_rank(tmp_path, schedule, needle):
    extra = ["--num-virtual-stages-per-pipeline-rank", "2"] if schedule == "looped-bfs" else []
    procs = launch_ranks(2, MOCK + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2",
                                    "--pipeline-schedule", schedule, "--metrics-file", str(tmp_path / "m.jsonl"),
                                    *extra], str(tmp_path))
    codes = wait_all(procs, timeout=120)
    assert codes == [2, 2], [stderr_of(str(tmp_path), r) for r in range(2)]
    errs = [stderr_of(str(tmp_path), r) for r in range(2)]
    assert errs[1] == "" and len(errs[0].splitlines()) == 1 and errs[0].startswith("error: "), errs
    assert needle in errs[0] and "Traceback" not in errs[0], errs
    assert not (tmp_path / "m.jsonl").exists()


def test_pretrain_gpt_script_exits_1_with_one_line(fx, tmp_path):
    """The same through a real `python pretrain_gpt.py` process (no stdout, nothing written)."""
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *[a.format(fx=fx) for a in FILE[:-7]],
                           "--data-path", str(fx / "badmagic"), *FILE[-6:], "--save", str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and "badmagic.idx: not an indexed-dataset index" in proc.stderr
    assert not (tmp_path / "ck").exists()


# Fuzzing --------------------------------------------------------------------------------------------------

_FLAGS = ["--micro-batch-size", "--global-batch-size", "--train-iters", "--lr", "--pipeline-schedule",
          "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers", "--hidden-size",
          "--seq-length", "--split", "--clip-grad", "--loss-spike-factor", "--max-consecutive-nonfinite",
          "--recompute-granularity", "--offload-chunks", "--data-path", "--bf16", "--fp16", "--config", "--seed",
          "--num-virtual-stages-per-pipeline-rank", "--hysteresis", "--lr-decay-style", "--eval-interval"]
_VALUES = st.one_of(st.sampled_from(["0", "-1", "1", "2", "3", "8", "1e-3", "nan", "inf", "1f1b", "gpipe", "full",
                                     "x", "", "--", "100,0,0", "/nonexistent", "cosine"]),
                    st.text(max_size=6))


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(st.one_of(st.sampled_from(_FLAGS), _VALUES), max_size=8))
def test_fuzzed_command_lines_parse_or_exit_2(capsys, tokens):
    """Any command line either parses (validated and derived) or exits 2 with `error:` lines only."""
    try:
        parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "2", *tokens])
    except SystemExit as exc:
        assert exc.code == 2
        err = capsys.readouterr().err
        assert err and all(line.startswith("error: ") for line in err.splitlines()), err


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.binary(min_size=0, max_size=HEADER_SIZE + 40), counts=st.tuples(st.integers(0, 2**64 - 1),
                                                                                st.integers(0, 2**64 - 1)))
def test_fuzzed_idx_headers_are_rejected_cleanly(tmp_path, header, counts):
    """Random bytes, and a valid magic/version/dtype with random (huge) counts: IndexFormatError or a
    consistent dataset, never MemoryError, OverflowError or a numpy error. (tests/data/test_indexed.py
    fuzzes byte edits of a valid index.)"""
    prefix = str(tmp_path / "f")
    with open(prefix + ".bin", "wb") as f:
        f.write(b"\0" * 16)
    for data in (header, b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, *counts) + header):
        with open(prefix + ".idx", "wb") as f:
            f.write(data)
        try:
            ds = IndexedDataset(prefix)
        except IndexFormatError:
            continue
        assert sum(len(ds[i]) for i in range(len(ds))) * ds.dtype.itemsize == 16
