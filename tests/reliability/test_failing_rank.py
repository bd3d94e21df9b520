"""Whichever rank fails: a runtime failure that one rank meets (its node-local `.idx` is corrupt, its disk
fills during a save, its gradient turns NaN, it dies) gives the job one `error:` line, from the rank that
met it (or from rank 0 when every rank meets it), and the exit status of docs/reliability.md's table.

Each failure is planted on rank 0 and on rank 1 of a 2-rank pipeline, under a plain launch (separate
processes, as `srun` starts them: each rank's own status shows) and under torchrun (its agent stops the
others once one exits; for a dead worker the agent's summary is the report, naming it as the root cause; `--tee 2`
labels each worker's stderr lines with its rank, so the printing rank shows there too). A node-local file is simulated by giving each rank its own working directory
(`node0/`, `node1/`) and a relative `--data-path`: a wrapper script changes to `node<RANK>/` before it
runs `pretrain_gpt.py`, so it works under any launcher. The same four failures under a real `srun`:
tests/launch/test_slurm.py::test_a_corrupt_index_on_one_rank_is_one_line_from_that_rank and
::test_a_runtime_failure_on_one_rank_under_srun.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from megatron_pp.data.indexed import write_dataset
from megatron_pp.training.faults import ENV_VAR
from tests.reliability.ranks import ROOT, free_port, launch_ranks, stderr_of, wait_all

TINY = ["--model-preset", "gpt-tiny", "--micro-batch-size", "1", "--global-batch-size", "2", "--seed", "3",
        "--pipeline-model-parallel-size", "2", "--heartbeat-timeout-seconds", "6", "--log-interval", "1000"]
DATA = ["--data-path", "corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--split", "100,0,0"]
# Runs the training script in node<RANK>/ of the directory it lives in: a per-rank (node-local) disk.
WRAPPER = """import os, runpy, sys
here = os.path.dirname(os.path.abspath(__file__))
os.chdir(os.path.join(here, "node" + os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))))
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def make_nodes(directory, bad_rank: int, script: str = os.path.join(ROOT, "pretrain_gpt.py")) -> str:
    """node0/ and node1/ under `directory`, each with a tiny corpus; `bad_rank`'s index has a foreign magic
    number. Returns the path of the wrapper that runs `script` in node<RANK>/."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 300, 40), 300) for _ in range(20)]
    for rank in (0, 1):
        node = os.path.join(directory, f"node{rank}")
        os.makedirs(node, exist_ok=True)
        write_dataset(os.path.join(node, "corpus"), docs, np.uint16)
    bad = os.path.join(directory, f"node{bad_rank}", "corpus.idx")
    with open(bad, "rb") as f:
        idx = f.read()
    with open(bad, "wb") as f:
        f.write(b"NOTANIDX!" + idx[9:])
    wrapper = os.path.join(directory, "on_node.py")
    with open(wrapper, "w") as f:
        f.write(WRAPPER.format(script=script))
    return wrapper


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def _plain(tmp_path, argv, env=None, script="pretrain_gpt.py"):
    procs = launch_ranks(2, argv, str(tmp_path), env=env, script=script)
    codes = wait_all(procs, timeout=240)
    return codes, [stderr_of(str(tmp_path), r) for r in range(2)]


def _torchrun(tmp_path, argv, env=None, script=None) -> subprocess.CompletedProcess:
    """torchrun with `--tee 2`: each worker's stderr reaches the agent's as `[default<rank>]:<line>`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--tee", "2", script or os.path.join(ROOT, "pretrain_gpt.py"), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _worker_error_lines(agent_stderr: str) -> list[tuple[int, str]]:
    """(rank, line) of every `error:` line in a `--tee 2` torchrun's output; none may be unlabelled."""
    assert _error_lines(agent_stderr) == [], agent_stderr  # every worker line carries its label
    return [(int(m.group(1)), m.group(2)) for m in re.finditer(r"^\[default(\d+)\]:(error: .*)$", agent_stderr, re.M)]


def _worker_statuses(agent_stderr: str) -> list[int]:
    return [int(code) for code in re.findall(r"^\s*exitcode\s+:\s*(-?\d+)", agent_stderr, re.M)]


def _worker_traceback(agent_stderr: str):
    """A frame of this project's code in a traceback (the agent's own ends in torch's files), or None."""
    return re.search(r'File ".*/megatron_pp/.*", line \d+', agent_stderr)


def _one_line_from(errs: list[str], rank: int, needle: str) -> str:
    """The job printed exactly one `error:` line, on `rank`'s stderr, naming `needle`; nothing else there."""
    lines = [(r, line) for r in range(2) for line in _error_lines(errs[r])]
    assert len(lines) == 1 and lines[0][0] == rank, errs
    assert needle in lines[0][1] and "Traceback" not in "".join(errs), errs
    return lines[0][1]


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_corrupt_node_local_index_is_one_line_from_its_rank(tmp_path, bad_rank):
    wrapper = make_nodes(str(tmp_path), bad_rank)
    codes, errs = _plain(tmp_path, TINY + DATA + ["--train-iters", "2"], script=wrapper)
    assert codes == [1, 1], (codes, errs)
    line = _one_line_from(errs, bad_rank, "corpus.idx: not an indexed-dataset index")
    assert line.startswith(f"error: rank {bad_rank}: "), line  # only that rank saw it: it says so


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_corrupt_node_local_index_under_torchrun(tmp_path, bad_rank):
    wrapper = make_nodes(str(tmp_path), bad_rank)
    proc = _torchrun(tmp_path, TINY + DATA + ["--train-iters", "2"], script=wrapper)
    lines = _worker_error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0][0] == bad_rank, proc.stderr  # printed once, by the rank that met it
    assert lines[0][1].startswith(f"error: rank {bad_rank}: corpus.idx: not an indexed"), proc.stderr
    statuses = _worker_statuses(proc.stderr)
    # The failing worker exits 1; the agent then SIGTERMs one still running or tearing down (-15).
    assert proc.returncode == 1 and 1 in statuses and set(statuses) <= {1, -15}, proc.stderr


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_full_disk_on_one_rank_is_one_line_from_that_rank(tmp_path, bad_rank):
    argv = TINY + ["--mock-data", "--train-iters", "2", "--save", str(tmp_path / "ck"), "--save-interval", "1"]
    codes, errs = _plain(tmp_path, argv, env={ENV_VAR: f"enospc_save@1:{bad_rank}"})
    assert codes == [1, 1], (codes, errs)
    line = _one_line_from(errs, bad_rank, "No space left on device")
    assert line.startswith(f"error: rank {bad_rank}: saving checkpoint "), line


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_nan_on_one_rank_stops_every_rank_with_one_line(tmp_path, bad_rank):
    """The gradient norm is agreed over the ranks, so every rank stops in the same iteration with the same
    line: rank 0 prints it once, for the job."""
    argv = TINY + ["--mock-data", "--train-iters", "4", "--max-consecutive-nonfinite", "1"]
    codes, errs = _plain(tmp_path, argv, env={ENV_VAR: f"nan_grad@2:{bad_rank}"})
    assert codes == [1, 1], (codes, errs)
    line = _one_line_from(errs, 0, "iteration 2: loss or gradients not finite for 1 consecutive step")
    assert not line.startswith("error: rank "), line


@pytest.mark.parametrize("dead_rank", [0, 1])
def test_a_dead_rank_is_named_once_by_the_survivor(tmp_path, dead_rank):
    """The survivor names the dead rank in one line and exits 1. Rank 0 of a plain launch hosts the job's
    store, so its death takes the store too: the survivor finds the store's port refusing connections and
    says that rank 0 is gone (torch's store client adds a warning of its own for the call that failed,
    which is not an `error:` line)."""
    argv = TINY + ["--mock-data", "--train-iters", "1000"]
    codes, errs = _plain(tmp_path, argv, env={ENV_VAR: f"kill_in_step@3:{dead_rank}"})
    survivor = 1 - dead_rank
    assert codes[dead_rank] == -signal.SIGKILL and codes[survivor] == 1, (codes, errs)
    needle = "rank 1 failed or stopped responding" if dead_rank == 1 else "rank 0 is gone: the rendezvous store at"
    lines = [(r, line) for r in range(2) for line in _error_lines(errs[r])]
    assert len(lines) == 1 and lines[0][0] == survivor and needle in lines[0][1], errs


# Under torchrun: the agent hosts the store and stops the other workers once one has exited, so what shows is
# the `error:` lines of the whole output and the agent's summary of each worker's status.

@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_full_disk_on_one_rank_under_torchrun(tmp_path, bad_rank):
    argv = TINY + ["--mock-data", "--train-iters", "2", "--save", str(tmp_path / "ck"), "--save-interval", "1"]
    proc = _torchrun(tmp_path, argv, env={ENV_VAR: f"enospc_save@1:{bad_rank}"})
    lines = _worker_error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0][0] == bad_rank, proc.stderr
    assert lines[0][1].startswith(f"error: rank {bad_rank}: saving checkpoint "), proc.stderr
    # (the agent's own traceback, ChildFailedError, is torchrun's way to end; no worker shows one)
    assert "No space left on device" in lines[0][1] and _worker_traceback(proc.stderr) is None, proc.stderr
    statuses = _worker_statuses(proc.stderr)
    assert proc.returncode == 1 and 1 in statuses and set(statuses) <= {1, -15}, proc.stderr


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_nan_on_one_rank_under_torchrun(tmp_path, bad_rank):
    argv = TINY + ["--mock-data", "--train-iters", "4", "--max-consecutive-nonfinite", "1"]
    proc = _torchrun(tmp_path, argv, env={ENV_VAR: f"nan_grad@2:{bad_rank}"})
    lines = _worker_error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0][0] == 0, proc.stderr  # every rank met it: rank 0 says it for the job
    assert lines[0][1].startswith("error: iteration 2: loss or gradients not finite for 1 consecutive step"), \
        proc.stderr
    assert _worker_traceback(proc.stderr) is None, proc.stderr
    statuses = _worker_statuses(proc.stderr)
    assert proc.returncode == 1 and 1 in statuses and set(statuses) <= {1, -15}, proc.stderr


@pytest.mark.parametrize("dead_rank", [0, 1])
def test_a_dead_rank_under_torchrun(tmp_path, dead_rank):
    """The agent sees the worker die, stops the other and names the dead one as the job's root cause, with
    its signal; the survivor, stopped within a moment of the death, says nothing (had it stayed long enough
    to see its watchdog's verdict, its one line would name the same rank)."""
    argv = TINY + ["--mock-data", "--train-iters", "1000"]
    proc = _torchrun(tmp_path, argv, env={ENV_VAR: f"kill_in_step@3:{dead_rank}"})
    root = proc.stderr.split("Root Cause (first observed failure):", 1)[-1]
    assert re.search(rf"^\s*rank\s+:\s*{dead_rank} \(local_rank", root, re.M), proc.stderr
    assert re.search(r"^\s*exitcode\s+:\s*-9 ", root, re.M), proc.stderr  # SIGKILL
    lines = _worker_error_lines(proc.stderr)
    assert len(lines) <= 1 and all(r != dead_rank and f"rank {dead_rank} failed" in line for r, line in lines), \
        proc.stderr
    assert proc.returncode == 1 and sorted(_worker_statuses(proc.stderr)) in ([-15, -9], [-9, 1]), proc.stderr
