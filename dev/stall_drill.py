"""Stall drill: freeze a tiny torchrun job (agent and workers) for longer than the heartbeat timeout, as a stall of
the whole host does (a paused VM, a swap storm, a loaded shared machine), then let them go on. The job must
finish: a stall is not a death (megatron_pp/training/watchdog.py).

    python dev/stall_drill.py                      # launch/configs/bpipe_gpt3_96b.yaml, tiny, bpipe, 65 s stall

Prints the job's exit status, its `error:` lines and its last iteration; exits 0 when the job finished
without an error line. Before the watchdog counted its own checks, every rank of this drill printed
`error: rank N failed or stopped responding (no heartbeat within 60 s)` and launch_config.py exited 2.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workers(marker: str) -> list[int]:
    """PIDs of this drill's processes running the training script (the torchrun agent and its workers): those
    whose environment carries `marker`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(c.endswith(b"pretrain_gpt.py") for c in cmdline) and marker.encode() in environ:
            found.append(int(entry))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="launch/configs/bpipe_gpt3_96b.yaml")
    parser.add_argument("--variant", default="bpipe")
    parser.add_argument("--stall", type=float, default=65.0, help="seconds every worker is frozen (default 65, "
                        "beyond the 60 s default heartbeat timeout)")
    parser.add_argument("--after-iteration", type=int, default=5, help="freeze once this iteration is logged")
    args = parser.parse_args(argv)
    if args.stall <= 0 or args.after_iteration < 1:
        parser.error("--stall must be > 0 and --after-iteration >= 1")
    marker = f"MEGATRON_PP_STALL_DRILL={os.getpid()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", marker.split("=")[0]: marker.split("=")[1]}
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        job = subprocess.Popen([sys.executable, "tools/launch_config.py", args.config, "--scale", "tiny", "--variant",
                                args.variant, "--set", f"train-iters={args.after_iteration + 400}"],
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        needle = f"iteration {args.after_iteration:>8}/"
        while job.poll() is None and needle not in open(log.name).read():
            time.sleep(0.2)
        workers = _workers(marker)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(args.stall)
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        try:
            status = job.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            status = "killed after 600 s"
        text = open(log.name).read()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    iterations = [line.split("|")[0].strip() for line in text.splitlines() if "iteration " in line]
    print(f"{len(workers)} processes (the torchrun agent and its workers) frozen for {args.stall:g} s; job exit "
          f"status {status}; "
          f"last: {iterations[-1] if iterations else 'none'}")
    for line in errors:
        print(f"  {line}")
    return 0 if status == 0 and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
