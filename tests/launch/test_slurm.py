"""launch/slurm/pretrain.sbatch on a real single-node SLURM (tests/launch/slurm_cluster.py), submitted as a
user would from a fresh clone: srun and torchrun mode with 2 tasks per node, USR1 preemption -> checkpoint
-> requeue -> resume with losses bitwise equal to an uninterrupted job, scancel mid-run, the time-limit
signal, a usage error and a killed rank. Tiny CPU models (gloo), a node without GPUs.

Where slurm-wlm and munge are not installed (`.ci/run` installs them) the module is skipped with that one
reason; with MEGATRON_PP_REQUIRE_SLURM=1 (set by `.ci/run` once they are) it fails instead.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.launch.slurm_cluster import LocalSlurm, missing_reason

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = "launch/slurm/pretrain.sbatch"
TRAIN_ITERS = 30  # about 3 s of training: longer than the batch script polls for PID files (0.2 s)
# Two pipeline stages, two tasks per node, one CPU each; what the jobs of this module train.
MODEL = ["--model-preset", "gpt-tiny", "--mock-data", "--pipeline-model-parallel-size", "2",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
         "--heartbeat-timeout-seconds", "20"]
JOB = ["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10"]


@pytest.fixture(scope="module")
def slurm():
    reason = missing_reason()
    if reason:
        if os.environ.get("MEGATRON_PP_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="mpp-slurm-")  # short: munged's socket path must fit in sun_path
    cluster = LocalSlurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """The checkout as it is (committed, uncommitted changes to tracked files, and new files git does not
    ignore, which a change in progress may import): no logs/, no .venv, and a space in its path."""
    path = str(tmp_path_factory.mktemp("launch") / "fresh clone")
    subprocess.run(["git", "clone", "-q", ROOT, path], check=True)
    diff = subprocess.run(["git", "-C", ROOT, "diff", "HEAD", "--binary"], check=True, capture_output=True).stdout
    if diff:
        subprocess.run(["git", "-C", path, "apply", "--whitespace=nowarn"], input=diff, check=True)
    new = subprocess.run(["git", "-C", ROOT, "ls-files", "--others", "--exclude-standard", "-z"], check=True,
                         capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, new):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(path, name))
    assert not os.path.exists(os.path.join(path, "logs"))
    return path


def _submit(slurm, cwd, args, sbatch_options=(), **env):
    """sbatch from `cwd` as a user would: the clone has no virtualenv of its own, so VENV names this one."""
    base = {k: v for k, v in slurm.env.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    res = subprocess.run(["sbatch", "--parsable", *JOB, *sbatch_options, *args], cwd=cwd,
                         env={**base, "VENV": sys.prefix, **env}, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.strip().split(";")[0])


def _output(cwd, job):
    path = os.path.join(cwd, f"slurm-{job}.out")
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def _rows(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if '"loss"' in line]


def _losses(rows):
    return {r["iteration"]: r["loss"] for r in rows if "loss" in r}


def _train(cwd, run, iters=TRAIN_ITERS, *extra):
    """Training flags writing to `run` (a directory under `cwd`, made here as a user would)."""
    os.makedirs(os.path.join(cwd, run), exist_ok=True)
    return ["pretrain_gpt.py", *MODEL, "--train-iters", str(iters), "--metrics-file", f"{run}/metrics.jsonl",
            "--save", f"{run}/ckpt", "--load", f"{run}/ckpt", "--save-interval", "1000", "--exit-signal-handler",
            *extra]


def _pids(log_dir):
    pids = os.path.join(log_dir, "pids")
    if not os.path.isdir(pids):
        return {}
    out = {}
    for name in os.listdir(pids):
        if name.endswith(".pid"):
            try:
                out[name] = int(open(os.path.join(pids, name)).read())
            except (OSError, ValueError):
                pass
    return out


def _wait(cond, what, timeout, slurm=None, job=None, cwd=None):
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            detail = ""
            if slurm is not None and job is not None:
                detail = f"\n{slurm.job(job)}\n{_output(cwd, job)}\n{slurm.daemon_logs()}"
            raise AssertionError(f"timed out waiting for {what}{detail}")
        time.sleep(0.1)


def _agents(job):
    """PIDs of the torchrun agents of `job` on this machine."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        # `python -m torch.distributed.run ...`: not srun, whose own command line names it too.
        if cmdline[1:3] == [b"-m", b"torch.distributed.run"] and f"SLURM_JOB_ID={job}".encode() in environ:
            found.append(int(entry))
    return found


def _signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def reference(slurm, clone):
    """The documented command from the fresh clone, nothing created beforehand: srun mode, uninterrupted."""
    job = _submit(slurm, clone, [SBATCH, *_train(clone, "runs/reference")])
    info = slurm.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 240)
    out = _output(clone, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out + slurm.daemon_logs()
    rows = _rows(os.path.join(clone, "runs/reference/metrics.jsonl"))
    assert sorted(_losses(rows)) == list(range(1, TRAIN_ITERS + 1)), rows
    return job, out, _losses(rows)


def test_srun_mode_from_a_fresh_clone(slurm, clone, reference):
    job, out, _ = reference
    assert f"megatron_pp job {job} (restart 0): 1 node(s) x 2 processes (no GPUs), srun mode, 1 CPUs per task" in out
    logs = os.path.join(clone, "logs", str(job))
    assert sorted(os.listdir(logs)) == ["pids", "rank-0.log", "rank-1.log", "srun.err"]
    assert os.listdir(os.path.join(logs, "pids")) == []  # each rank removes its PID file when it ends
    assert "world 2 = tp 1 x pp 2 x dp 1" in open(os.path.join(logs, "rank-0.log")).read()


def test_usr1_preemption_saves_requeues_and_resumes_bitwise(slurm, clone, reference):
    _, _, expected = reference
    run = "runs/preempted"
    job = _submit(slurm, clone, [SBATCH, *_train(clone, run)])
    log_dir, metrics = os.path.join(clone, "logs", str(job)), os.path.join(clone, run, "metrics.jsonl")
    # Freeze both ranks mid-run so that the signal lands before the last iteration whatever the machine's speed.
    _wait(lambda: len(_rows(metrics)) >= 2 and len(_pids(log_dir)) == 2, "iteration 2", 240, slurm, job, clone)
    pids = list(_pids(log_dir).values())
    _signal_all(pids, signal.SIGSTOP)
    try:
        slurm.scancel(job, "--batch", "--signal=USR1")  # what --signal=B:USR1@N delivers: the batch shell only
        _wait(lambda: _output(clone, job).count("USR1 to pid") >= 2, "the USR1 forwarding", 60, slurm, job, clone)
    finally:
        _signal_all(pids, signal.SIGCONT)
    slurm.wait_for(job, ("PENDING", "REQUEUED", "RUNNING"), 120)
    _wait(lambda: int(slurm.job(job).get("Restarts", 0)) == 1, "the requeue", 120, slurm, job, clone)
    info = slurm.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 240)
    out = _output(clone, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    first_run = out.split("(restart 1)")[0]
    assert first_run.count("USR1 to pid") == 2, out  # each rank signalled once
    assert f"requeueing job {job}" in first_run, out
    rows = _rows(metrics)
    iterations = [r["iteration"] for r in rows]
    # The first run stopped part way; the second went on from its checkpoint to the end, not from 1.
    assert iterations == list(range(1, TRAIN_ITERS + 1)), iterations
    assert _losses(rows) == expected  # bitwise: the same floats through JSON


def test_torchrun_mode_one_agent_per_node_and_early_usr1(slurm, clone, reference):
    """2 tasks per node: one torchrun agent starting 2 workers. A USR1 that comes while the ranks are still
    starting is held until they are in their loops, then each rank is signalled once."""
    _, _, expected = reference
    run = "runs/torchrun"
    job = _submit(slurm, clone, [SBATCH, *_train(clone, run)], LAUNCH_MODE="torchrun")
    # Once the batch shell runs (a signal sent before it exists is dropped), while the ranks start.
    _wait(lambda: "torchrun mode" in _output(clone, job), "the batch script", 120, slurm, job, clone)
    slurm.scancel(job, "--batch", "--signal=USR1")
    _wait(lambda: int(slurm.job(job).get("Restarts", 0)) == 1, "the requeue", 240, slurm, job, clone)
    log_dir = os.path.join(clone, "logs", str(job))
    _wait(lambda: len(_pids(log_dir)) == 2, "the resumed ranks", 240, slurm, job, clone)
    agents = _agents(job)
    info = slurm.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 240)
    out = _output(clone, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert len(agents) == 1, agents
    assert "1 node(s) x 2 processes (no GPUs), torchrun mode" in out
    first_run = out.split("(restart 1)")[0]
    assert first_run.count("USR1 to pid") == 2, out
    logs = os.path.join(clone, "logs", str(job))
    assert sorted(f for f in os.listdir(logs) if f.endswith(".log")) == ["node-0.log"]
    node_log = open(os.path.join(logs, "node-0.log")).read()
    # One agent: one rendezvous of 2 workers (two agents would each have started 2, or failed).
    assert node_log.count("world 2 = tp 1 x pp 2 x dp 1") == 2, node_log  # once per run
    assert _losses(_rows(os.path.join(clone, run, "metrics.jsonl"))) == expected


def test_scontrol_requeue_then_scancel_save_on_sigterm(slurm, clone, tmp_path):
    """Submitted from outside the repository, by the script's path; relative paths are the submit dir's.
    An operator's `scontrol requeue` and then `scancel` each reach the ranks as SIGTERM: both save."""
    elsewhere = tmp_path / "not the repo"
    elsewhere.mkdir()
    job = _submit(slurm, str(elsewhere), [os.path.join(clone, SBATCH), *_train(str(elsewhere), "run", 100000)])
    metrics = elsewhere / "run" / "metrics.jsonl"
    latest = elsewhere / "run" / "ckpt" / "latest_checkpointed_iteration.txt"
    _wait(lambda: len(_rows(metrics)) >= 2, "iteration 2", 240, slurm, job, str(elsewhere))
    slurm.scontrol("requeue", str(job))
    _wait(latest.exists, "the checkpoint of the requeue", 60, slurm, job, str(elsewhere))
    first = int(latest.read_text())
    assert first == _rows(metrics)[-1]["iteration"] >= 2
    # The requeued run resumes after the checkpoint.
    _wait(lambda: _rows(metrics)[-1]["iteration"] >= first + 2, "the resumed run", 240, slurm, job, str(elsewhere))
    assert [r["iteration"] for r in _rows(metrics)][first:first + 2] == [first + 1, first + 2]
    assert int(slurm.job(job)["Restarts"]) == 1
    slurm.scancel(job)
    info = slurm.wait_for(job, ("CANCELLED",), 60)
    _wait(lambda: int(latest.read_text()) > first, "the checkpoint of the cancel", 60, slurm, job, str(elsewhere))
    assert int(latest.read_text()) == _rows(metrics)[-1]["iteration"], info
    assert (elsewhere / "logs" / str(job) / "rank-0.log").exists()
    assert "(restart 1)" in _output(str(elsewhere), job)


def test_time_limit_signal_saves_and_requeues(slurm, clone):
    run = "runs/timelimit"
    # Two minutes, USR1 45 s before the end: the ranks have 75 s to start training and write their PID files
    # (on a loaded 2-core machine importing torch in two processes alone can take half of that).
    job = _submit(slurm, clone, [SBATCH, *_train(clone, run, 100000)],
                  sbatch_options=["--time=2", "--signal=B:USR1@45"], SIGNAL_LEAD_S="45", SAVE_WAIT_S="25")
    _wait(lambda: int(slurm.job(job).get("Restarts", 0)) == 1, "the time-limit requeue", 240, slurm, job, clone)
    slurm.scancel(job)
    out = _output(clone, job)
    assert out.count("USR1 to pid") == 2 and f"requeueing job {job}" in out, out
    saved = int(open(os.path.join(clone, run, "ckpt", "latest_checkpointed_iteration.txt")).read())
    assert saved >= 1


def test_usage_errors_reach_the_job_output_once_with_exit_code_2(slurm, clone):
    bad_flag = _submit(slurm, clone, [SBATCH, "pretrain_gpt.py", "--no-such-flag"])
    no_script = _submit(slurm, clone, [SBATCH])
    bad_wait = _submit(slurm, clone, [SBATCH, "pretrain_gpt.py"], SAVE_WAIT_S="110")
    for job in (bad_flag, no_script, bad_wait):
        info = slurm.wait_for(job, ("FAILED", "COMPLETED"), 120)
        assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), (info, _output(clone, job))
    out = _output(clone, bad_flag)
    assert out.count("unrecognized arguments: --no-such-flag") == 1, out
    out = _output(clone, no_script)
    assert "usage:" in out and f" {SBATCH} TRAINING_SCRIPT" in out and "slurm_script" not in out, out
    out = _output(clone, bad_wait)
    assert out.strip().splitlines() == [f"{SBATCH}: SAVE_WAIT_S=110 must be 1..105 (SIGNAL_LEAD_S=120, the N of "
                                        "--signal=B:USR1@N, less 15 s for the requeue)"], out


def test_a_killed_rank_ends_the_job_through_srun(slurm, clone):
    run = "runs/killed"
    job = _submit(slurm, clone, [SBATCH, *_train(clone, run, 100000)])
    log_dir = os.path.join(clone, "logs", str(job))
    _wait(lambda: len(_rows(os.path.join(clone, run, "metrics.jsonl"))) >= 2 and len(_pids(log_dir)) == 2,
          "iteration 2", 240, slurm, job, clone)
    victim = [pid for name, pid in _pids(log_dir).items() if name.endswith(".1.pid")][0]
    os.kill(victim, signal.SIGKILL)
    info = slurm.wait_for(job, ("FAILED", "CANCELLED", "COMPLETED"), 240)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", info
    out = _output(clone, job)
    assert out.count("training step failed with exit code 1") == 1, out
    assert out.count("task 1 (rank 1) died first: Killed") == 1, out
    # srun --kill-on-bad-exit ended rank 0 (no wall-clock bound: that would depend on the machine's load); had
    # its watchdog done it instead (20 s heartbeat), rank 0 would have exited 1 with a line of its own.
    srun_err = open(os.path.join(log_dir, "srun.err")).read()
    assert "task 0: Exited" not in srun_err, srun_err
    rank0 = open(os.path.join(log_dir, "rank-0.log"), errors="replace").read()
    assert not [line for line in rank0.splitlines() if line.startswith("error: ")], rank0


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_corrupt_index_on_one_rank_is_one_line_from_that_rank(slurm, clone, bad_rank):
    """srun mode, 2 tasks: rank `bad_rank`'s node-local `.idx` is corrupt (tests/reliability/test_failing_rank.py
    makes a directory per rank and a wrapper that runs the training script in its rank's). That rank's log
    holds the job's one `error:` line, naming itself; the job exits 1 (a runtime failure), not 2, not silent."""
    from tests.reliability.test_failing_rank import DATA, make_nodes

    where = os.path.join(clone, f"nodes{bad_rank}")
    os.makedirs(where)
    wrapper = make_nodes(where, bad_rank, script=os.path.join(clone, "pretrain_gpt.py"))
    flags = [a for a in MODEL if a != "--mock-data"]
    job = _submit(slurm, clone, [SBATCH, os.path.relpath(wrapper, clone), *flags, *DATA, "--train-iters", "2"])
    info = slurm.wait_for(job, ("FAILED", "COMPLETED"), 240)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), (info, _output(clone, job))
    logs = {rank: open(os.path.join(clone, "logs", str(job), f"rank-{rank}.log"), errors="replace").read()
            for rank in (0, 1)}
    lines = [(rank, line) for rank, text in logs.items() for line in text.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0][0] == bad_rank, logs
    assert lines[0][1].startswith(f"error: rank {bad_rank}: corpus.idx: not an indexed-dataset index"), lines
    assert "Traceback" not in logs[0] + logs[1], logs
    assert _output(clone, job).count(lines[0][1]) == 1, _output(clone, job)


# (fault, rank, the job's one `error:` line starts with, the rank whose log holds it): see
# tests/reliability/test_failing_rank.py for the same failures under a plain launch and under torchrun.
FAILURES = [("enospc_save@1", 0, "error: rank 0: saving checkpoint ", 0),
            ("enospc_save@1", 1, "error: rank 1: saving checkpoint ", 1),
            # the gradient norm is agreed over the ranks: every rank stops, rank 0 says it once for the job
            ("nan_grad@2", 0, "error: iteration 2: loss or gradients not finite", 0),
            ("nan_grad@2", 1, "error: iteration 2: loss or gradients not finite", 0)]


@pytest.mark.parametrize("fault,rank,line,printer", FAILURES, ids=[f"{f.split('@')[0]}-rank{r}" for f, r, *_ in FAILURES])
def test_a_runtime_failure_on_one_rank_under_srun(slurm, clone, fault, rank, line, printer):
    """srun mode, 2 tasks: a full disk during a save, or a NaN, on one rank. The job exits 1 (a runtime
    failure) and its one `error:` line is in the log of the rank that printed it, and once in the job's output."""
    run = f"runs/{fault.split('@')[0]}{rank}"
    job = _submit(slurm, clone, [SBATCH, *_train(clone, run, 4, "--save-interval", "1", "--max-consecutive-nonfinite", "1")],
                  MEGATRON_PP_INJECT_FAULTS=f"{fault}:{rank}")
    info = slurm.wait_for(job, ("FAILED", "COMPLETED"), 240)
    out = _output(clone, job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), (info, out)
    logs = {r: open(os.path.join(clone, "logs", str(job), f"rank-{r}.log"), errors="replace").read() for r in (0, 1)}
    lines = [(r, text_line) for r, text in logs.items() for text_line in text.splitlines() if text_line.startswith("error: ")]
    assert len(lines) == 1 and lines[0][0] == printer and lines[0][1].startswith(line), logs
    assert "Traceback" not in logs[0] + logs[1], logs
    assert out.count(lines[0][1]) == 1, out


@pytest.mark.parametrize("rank", [0, 1])
def test_a_dead_rank_under_srun(slurm, clone, rank):
    """srun mode, 2 tasks, one SIGKILLed in its third step. The job output names the task that died first
    (srun --kill-on-bad-exit then ends the other) and the job exits 1, a runtime failure. When rank 0 dies
    its store goes with it and the survivor says rank 0 is gone, once; when rank 1 dies srun stops rank 0
    before its watchdog could name it, and nothing else is said."""
    run = f"runs/dead{rank}"
    job = _submit(slurm, clone, [SBATCH, *_train(clone, run, 1000)], MEGATRON_PP_INJECT_FAULTS=f"kill_in_step@3:{rank}")
    info = slurm.wait_for(job, ("FAILED", "COMPLETED", "CANCELLED"), 240)
    out = _output(clone, job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), (info, out)
    assert out.count(f"task {rank} (rank {rank}) died first: Killed") == 1, out
    logs = {r: open(os.path.join(clone, "logs", str(job), f"rank-{r}.log"), errors="replace").read() for r in (0, 1)}
    lines = [(r, text_line) for r, text in logs.items() for text_line in text.splitlines() if text_line.startswith("error: ")]
    if rank == 0:
        assert len(lines) == 1 and lines[0][0] == 1 and lines[0][1].startswith("error: rank 0 is gone: "), logs
        assert out.count(lines[0][1]) == 1, out
    else:
        assert all("rank 1 failed or stopped responding" in text_line for _, text_line in lines) and len(lines) <= 1, logs
    assert "Traceback" not in logs[0] + logs[1], logs
