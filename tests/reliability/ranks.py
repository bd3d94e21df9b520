"""Start the ranks of a small world as separate `pretrain_gpt.py` processes, the way srun starts tasks:
no torchrun agent that would kill the survivors when one rank dies, so the tests see what the ranks
themselves do. Each rank's stdout and stderr go to files in `log_dir` (rank<N>.out / rank<N>.err)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(world_size: int, argv: Sequence[str], log_dir: str, env: Optional[dict] = None,
                 script: str = "pretrain_gpt.py", cwds: Optional[Sequence[str]] = None) -> list[subprocess.Popen]:
    """Start the ranks (in `cwds[rank]`, default the repository root)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1"}
        out = open(os.path.join(log_dir, f"rank{rank}.out"), "w")
        err = open(os.path.join(log_dir, f"rank{rank}.err"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, script), *argv], stdout=out, stderr=err,
                                      env=rank_env, cwd=cwds[rank] if cwds else ROOT))
        out.close()
        err.close()
    return procs


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> list[Optional[int]]:
    """Exit codes (None for a rank still running at the deadline, which is then killed)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes


def stderr_of(log_dir: str, rank: int) -> str:
    with open(os.path.join(log_dir, f"rank{rank}.err")) as f:
        return f.read()


def stdout_of(log_dir: str, rank: int) -> str:
    with open(os.path.join(log_dir, f"rank{rank}.out")) as f:
        return f.read()
