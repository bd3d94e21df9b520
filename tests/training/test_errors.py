"""A multi-process job reports errors like one program (megatron_pp/training/errors.py): under torchrun
with 2 and 4 workers, and under a plain launch (separate processes, as srun starts them), a refused flag
combination and a bad dataset file each print one `error:` line for the whole job; usage errors exit 2
on every rank, runtime failures exit 1; a problem only one rank sees is printed by that rank, named."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megatron_pp.data.indexed import write_dataset
from megatron_pp.training.errors import one_line
from tests.reliability.ranks import ROOT, free_port, launch_ranks, stderr_of, wait_all

TINY = ["--model-preset", "gpt-tiny", "--micro-batch-size", "1", "--train-iters", "2", "--pipeline-model-parallel-size",
        "2", "--heartbeat-timeout-seconds", "20"]


def _refused(world: int) -> list[str]:
    """2BW needs m >= p: one microbatch per replica on two stages, refused once the world is known."""
    return TINY + ["--mock-data", "--global-batch-size", str(world // 2), "--pipeline-schedule", "2bw"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A valid corpus and a copy whose index has a foreign magic number."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    write_dataset(str(d / "corpus"), [np.append(rng.integers(0, 300, 40), 300) for _ in range(20)], np.uint16)
    idx = (d / "corpus.idx").read_bytes()
    (d / "bad.idx").write_bytes(b"NOTANIDX!" + idx[9:])
    (d / "bad.bin").write_bytes((d / "corpus.bin").read_bytes())
    return d


def _file_args(path: str, world: int) -> list[str]:
    return TINY + ["--global-batch-size", str(2 * world), "--data-path", path, "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", "300", "--split", "100,0,0"]


def _torchrun(world: int, argv: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _error_lines(text: str) -> list[str]:
    # torchrun may prefix a worker's lines with its local rank ("[default0]:") when asked to; not here.
    return [line for line in text.splitlines() if line.startswith("error: ")]


def _worker_statuses(agent_stderr: str) -> list[int]:
    """The exit status of every worker in torchrun's failure summary."""
    return [int(code) for code in re.findall(r"^\s*exitcode\s+:\s*(-?\d+)", agent_stderr, re.M)]


@pytest.mark.parametrize("world", [2, 4])
def test_a_refused_flag_combination_is_one_line_and_every_rank_exits_2_under_torchrun(world):
    proc = _torchrun(world, _refused(world))
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "m >= p" in lines[0], proc.stderr
    assert proc.stdout == "" and "Traceback (most recent call last):\n  File \"" + ROOT not in proc.stderr
    assert _worker_statuses(proc.stderr) == [2] * world, proc.stderr  # torchrun itself always exits 1
    assert proc.returncode == 1


@pytest.mark.parametrize("world", [2, 4])
def test_a_bad_dataset_file_is_one_line_and_a_runtime_failure_under_torchrun(corpus, world):
    proc = _torchrun(world, _file_args(str(corpus / "bad"), world))
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "bad.idx: not an indexed-dataset index" in lines[0], proc.stderr
    # Every rank read the same file: the line is the plain one, printed by rank 0, without a rank prefix.
    assert lines[0].startswith("error: ") and not lines[0].startswith("error: rank "), lines
    statuses = _worker_statuses(proc.stderr)
    # The first worker to exit exits 1; the agent then SIGTERMs any still tearing down (-15).
    assert 1 in statuses and set(statuses) <= {1, -15}, proc.stderr


def test_plain_launch_exit_statuses(corpus, tmp_path):
    """Without an agent that stops the others, each rank's own status shows: 1 for a bad file, on every rank."""
    procs = launch_ranks(2, _file_args(str(corpus / "bad"), 2), str(tmp_path))
    assert wait_all(procs, timeout=180) == [1, 1], [stderr_of(str(tmp_path), r) for r in range(2)]
    errs = [stderr_of(str(tmp_path), r) for r in range(2)]
    assert len(_error_lines(errs[0])) == 1 and errs[1] == "", errs


def test_a_problem_only_one_rank_sees_is_printed_by_that_rank(corpus, tmp_path):
    """A relative --data-path that exists in rank 0's directory and not in rank 1's (a node-local disk):
    rank 1 names the missing file, rank 0 (which found nothing) prints nothing, both exit 2."""
    here, there = tmp_path / "node0", tmp_path / "node1"
    here.mkdir()
    there.mkdir()
    for suffix in (".bin", ".idx"):
        os.symlink(corpus / f"corpus{suffix}", here / f"corpus{suffix}")
    procs = launch_ranks(2, _file_args("corpus", 2), str(tmp_path), cwds=[str(here), str(there)])
    assert wait_all(procs, timeout=180) == [2, 2], [stderr_of(str(tmp_path), r) for r in range(2)]
    errs = [stderr_of(str(tmp_path), r) for r in range(2)]
    assert errs[0] == "" and len(errs[1].splitlines()) == 1, errs
    assert errs[1].startswith("error: rank 1: ") and "corpus" in errs[1], errs


def test_one_line_escapes_control_characters_and_joins_lines():
    assert one_line("bad value\n  '\x1b[31m'") == "bad value '\\x1b[31m'"
