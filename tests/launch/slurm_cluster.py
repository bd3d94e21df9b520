"""A real single-node SLURM for the launch tests: munged, slurmctld and slurmd from Debian's `slurm-wlm`
and `munge`, each started in the foreground on its own socket, ports, spool and state directories (nothing
of the machine's own SLURM or munge configuration is read or touched), and ended by its PID.

The node declares no GPUs, so jobs pass `--gpus-per-node=0`. `AuthInfo=cred_expire` is the knob that holds
a requeued job before it may run again (120 s by default); the cluster sets it to its minimum region so
that a requeue test does not wait two minutes.
"""
from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from typing import Optional

PACKAGES = "slurm-wlm munge"
DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_reason() -> Optional[str]:
    """Why a real SLURM cannot be brought up here (one line), or None when it can."""
    missing = [d for d in DAEMONS + ("sbatch", "scontrol") if shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin") is None]
    if missing:
        return (f"{PACKAGES} not installed ({', '.join(missing)} missing); "
                f"`apt-get install -y {PACKAGES}` (as .ci/run does) enables the real-SLURM launch tests")
    if os.geteuid() != 0:
        return "the real-SLURM launch tests need root (slurmd starts job steps as the submitting user)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies without its finalizers (killed)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _daemon(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin") or name


class LocalSlurm:
    """One controller and one compute node on this machine. `env` is the environment for the client
    commands (sbatch, scontrol, scancel) and, through sbatch, for the jobs."""

    def __init__(self, root: str, cpus: int = 4) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}
        os.makedirs(root, exist_ok=True)
        for sub in ("state", "spool", "munge"):
            os.makedirs(os.path.join(root, sub), mode=0o700, exist_ok=True)
        self.munge_socket = os.path.join(root, "munge", "munge.socket")
        ctld_port, slurmd_port = _free_ports(2)
        self.conf = os.path.join(root, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write("\n".join([
                "ClusterName=megatronpptest",
                # Job ids (and so the script's default MASTER_PORT) apart from another test run's.
                f"FirstJobId={random.randrange(1000, 19000, 100)}",
                f"SlurmctldHost={self.node}(127.0.0.1)",
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={slurmd_port}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                # cred_expire also holds a requeued job this long before it is eligible again (default 120 s).
                f"AuthInfo=socket={self.munge_socket},cred_expire=10",
                f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool",
                f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd.pid",
                f"SlurmctldLogFile={root}/slurmctld.log",
                f"SlurmdLogFile={root}/slurmd.log",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SchedulerType=sched/builtin",
                "SchedulerParameters=sched_interval=1",
                "JobCompType=jobcomp/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "KillWait=30",
                "MinJobAge=600",
                # The node declares more CPUs than a small test machine has; the configuration wins.
                "SlurmdParameters=config_overrides",
                f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
                "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]))
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.env["PATH"] = self.env.get("PATH", "") + ":/usr/sbin"

    # Daemons ----------------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> "LocalSlurm":
        key = os.path.join(self.root, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        self._spawn("munged", [_daemon("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.root}/munge/munged.pid",
                               f"--log-file={self.root}/munged.log", f"--seed-file={self.root}/munge/munge.seed"])
        self._wait(lambda: os.path.exists(self.munge_socket), "munged's socket", timeout)
        self._spawn("slurmctld", [_daemon("slurmctld"), "-D", "-i", "-f", self.conf])
        self._spawn("slurmd", [_daemon("slurmd"), "-D", "-f", self.conf, "-N", self.node])
        self._wait(lambda: "idle" in self.scontrol("show", "node", self.node, check=False).lower(),
                   "the node to become idle", timeout)
        return self

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.root, f"{name}.stdout"), "w")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=_die_with_parent)

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                                       + self.daemon_logs())
            if time.time() > deadline:
                raise RuntimeError(f"timed out waiting for {what}:\n" + self.daemon_logs())
            time.sleep(0.2)

    def stop(self) -> None:
        """End every job, then the daemons (slurmd first), each by its PID; SIGKILL after 10 s."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=self.env,
                           capture_output=True, timeout=30)
            subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True, timeout=30)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        # slurmstepd processes of unfinished jobs outlive slurmd: end them by the PIDs their sessions hold.
        for pid in self._stray_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _stray_pids(self) -> list[int]:
        """Processes still running with this cluster's configuration in their environment."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"SLURM_CONF={self.conf}".encode() in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
        return pids

    def daemon_logs(self, lines: int = 30) -> str:
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "munged.stdout", "slurmctld.stdout", "slurmd.stdout"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                tail = open(path, errors="replace").read().splitlines()[-lines:]
                out.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(out)

    # Client commands ---------------------------------------------------------------------------------

    def scontrol(self, *args: str, check: bool = True) -> str:
        res = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=30)
        if check and res.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def scancel(self, job: int, *args: str) -> None:
        subprocess.run(["scancel", *args, str(job)], env=self.env, check=True, capture_output=True, timeout=30)

    def job(self, job: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, Command, ...)."""
        text = self.scontrol("show", "job", str(job))
        fields = {}
        for line in text.splitlines():
            line = line.strip()
            # Command= and the paths run to the end of their line (they may hold spaces).
            if re.match(r"^(Command|WorkDir|StdOut|StdErr)=", line):
                key, value = line.split("=", 1)
                fields[key] = value
                continue
            for key, value in re.findall(r"(\w[\w/:]*)=(\S*)", line):
                fields.setdefault(key, value)
        return fields

    def wait_for(self, job: int, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.time() + timeout
        while True:
            info = self.job(job)
            if info.get("JobState") in states:
                return info
            if time.time() > deadline:
                raise AssertionError(f"job {job} is {info.get('JobState')} after {timeout:.0f} s, "
                                     f"not {'/'.join(states)}: {info}\n{self.daemon_logs()}")
            time.sleep(0.5)
