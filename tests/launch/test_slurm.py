"""launch/slurm/pretrain.sbatch end to end on fake srun/scontrol: a 4-process pipeline job, preempted
with USR1 on the batch shell, saves, exits and requeues; the requeued run resumes from the checkpoint."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_BIN = os.path.join(ROOT, "tests", "launch", "fake_slurm")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if '"loss"' in line]


def _submit(tmp_path, log_dir, metrics, train_iters):
    env = {**os.environ, "PATH": FAKE_BIN + os.pathsep + os.environ["PATH"], "SLURM_JOB_ID": "4242",
           "SLURM_SUBMIT_DIR": ROOT, "GPUS_PER_NODE": "4", "LOG_DIR": str(log_dir), "MASTER_PORT": str(_free_port()),
           "VENV": os.path.dirname(os.path.dirname(sys.executable)), "OMP_NUM_THREADS": "1",
           "FAKE_SLURM_LOG": str(tmp_path / "scontrol.log"), "SAVE_WAIT_S": "60"}
    cmd = ["bash", os.path.join(ROOT, "launch", "slurm", "pretrain.sbatch"), "pretrain_gpt.py",
           "--model-preset", "gpt-tiny", "--mock-data", "--pipeline-model-parallel-size", "2",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(train_iters),
           "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--save-interval", "1000",
           "--exit-signal-handler", "--metrics-file", str(metrics), "--log-interval", "50"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_usr1_saves_requeues_and_the_requeued_job_resumes(tmp_path):
    log_dir, metrics = tmp_path / "logs", tmp_path / "metrics.jsonl"
    job = _submit(tmp_path, log_dir, metrics, train_iters=100000)
    deadline = time.time() + 180
    while len(_rows(metrics)) < 3:
        assert job.poll() is None, job.stdout.read()
        assert time.time() < deadline, "the job never reached iteration 3"
        time.sleep(0.2)
    assert len(list((log_dir / "pids").glob("*.pid"))) == 4  # every rank registered for signalling
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 delivers: the batch shell only
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert (tmp_path / "scontrol.log").read_text().strip() == "requeue 4242", out
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    first = _rows(metrics)
    assert saved == first[-1]["iteration"] and saved >= 3, (saved, first[-1])

    # The requeued job: same script, same flags (a finite run this time, so the test ends).
    job = _submit(tmp_path, log_dir, metrics, train_iters=saved + 3)
    out, _ = job.communicate(timeout=180)
    assert job.returncode == 0, out
    resumed = _rows(metrics)[len(first):]
    assert [r["iteration"] for r in resumed] == [saved + 1, saved + 2, saved + 3], out
    assert resumed[0]["consumed_samples"] == (saved + 1) * 8
