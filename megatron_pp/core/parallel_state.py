"""Process-group layout for tensor, pipeline and data parallelism.

The rank arithmetic is a pure function (`RankLayout`) so it can be documented, golden-tested and used by
tools without any process group. `ParallelState` builds the torch.distributed groups from that layout
once and is then passed explicitly to everything that communicates; nothing here lives in module
globals. `init_distributed` reads the launcher's environment (torchrun, then an srun step, else a single
process) and creates the default group.

Rank order follows Megatron-LM's default: tensor-parallel rank varies fastest, then data-parallel, then
pipeline. Worked example, 16 ranks with tp=2, pp=4 (so dp=2):

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

    tensor-parallel groups   [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]
    data-parallel groups     [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]
    pipeline groups          [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]
    model-parallel groups    [0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]   (tp x pp, one dp replica)
    embedding groups         [0,12] [1,13] [2,14] [3,15]   (first and last pipeline rank)

Tensor-parallel peers are adjacent ranks, so they share a node (NVLink) whenever tp divides the GPUs per
node; pipeline neighbours are `tp * dp` ranks apart, i.e. usually on different nodes, which is what the
point-to-point traffic of pipelining tolerates best.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_pp.core.p2p import warm_up


_PAIR_GROUPS: dict[tuple, dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]]] = {}


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the flag to change."""


@dataclass(frozen=True)
class RankCoords:
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class RankLayout:
    """Pure rank arithmetic for world = tp * dp * pp (dp is derived)."""

    world_size: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for flag, value in (("--tensor-model-parallel-size", self.tp), ("--pipeline-model-parallel-size", self.pp)):
            if value < 1:
                raise LayoutError(f"{flag} must be >= 1, got {value}")
        if self.world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {self.world_size}")
        if self.world_size % (self.tp * self.pp) != 0:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {self.tp} x "
                f"--pipeline-model-parallel-size {self.pp} = {self.tp * self.pp}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        return RankCoords(tp=rank % self.tp, dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp))

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def mp_groups(self) -> list[list[int]]:
        return [
            [self.rank(t, d, p) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)
        ]

    def embedding_groups(self) -> list[list[int]]:
        """First and last rank of each pipeline (a single rank when pp == 1)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def all_groups(self) -> dict[str, list[list[int]]]:
        return {
            "tp": self.tp_groups(),
            "dp": self.dp_groups(),
            "pp": self.pp_groups(),
            "mp": self.mp_groups(),
            "embedding": self.embedding_groups(),
        }


@dataclass
class ParallelState:
    """This rank's coordinates and process groups. Build with `ParallelState.build`.

    Groups are None when their size is 1 *and* no distributed backend is running (a plain single
    process); code must treat a None group as "size 1, no communication".
    """

    layout: RankLayout
    rank: int
    device: torch.device
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    mp_group: Optional[dist.ProcessGroup] = None
    embedding_group: Optional[dist.ProcessGroup] = None
    pp_ranks: list[int] = field(default_factory=list)  # global ranks of my pipeline, by pp rank
    embedding_ranks: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, device: Optional[torch.device] = None) -> "ParallelState":
        """Create every group of the layout. Collective: all ranks of the world must call it."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        layout = RankLayout(world, tp, pp)
        if device is None:
            device = default_device()
        state = cls(layout=layout, rank=rank, device=device)
        if not dist.is_initialized():
            state.pp_ranks, state.embedding_ranks = [0], [0]
            return state
        mine = layout.coords(rank)
        # new_group is collective over the whole world, so every rank creates every group in the same
        # order and keeps the ones it belongs to.
        for name, groups in layout.all_groups().items():
            for ranks in groups:
                group = dist.new_group(ranks)
                if rank in ranks:
                    setattr(state, f"{name}_group", group)
                    if name == "pp":
                        state.pp_ranks = list(ranks)
                    elif name == "embedding":
                        state.embedding_ranks = list(ranks)
        assert state.pp_ranks[mine.pp] == rank
        if state.pp_group is not None and layout.pp > 1:
            warm_up(state.pp_group, state.device)
        return state

    def pair_groups(self, pairs: Sequence[tuple[int, int]]) -> dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]]:
        """This rank's two-rank process groups for BPipe's parking `pairs` ((evictor, acceptor) pipeline
        ranks), by partner pp rank: (the evictions' group, the loads' group).

        Collective: `new_group` involves the whole world, so every rank creates the groups of every
        pipeline (each data- and tensor-parallel replica has its own pairs) in the same order and keeps its
        own, then warms its own up (see `p2p.warm_up`). Built once per (world, layout, pairs) and cached,
        since schedules are rebuilt (tests, evaluation) far more often than groups may be created.
        """
        key = (dist.group.WORLD, self.layout, tuple(pairs))
        if key not in _PAIR_GROUPS:
            mine: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
            for pipeline in self.layout.pp_groups():
                for x, y in pairs:
                    ranks = [pipeline[x], pipeline[y]]
                    groups = (dist.new_group(ranks), dist.new_group(ranks))
                    if self.rank in ranks:
                        mine[y if self.rank == pipeline[x] else x] = groups
            for groups in mine.values():
                for group in groups:
                    warm_up(group, self.device)
            _PAIR_GROUPS[key] = mine
        return _PAIR_GROUPS[key]

    # Coordinates -------------------------------------------------------------------------------------
    @property
    def coords(self) -> RankCoords:
        return self.layout.coords(self.rank)

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def pp_global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank `pp_rank` in my pipeline (for point-to-point)."""
        return self.pp_ranks[pp_rank]

    def destroy(self) -> None:
        for name in ("tp", "dp", "pp", "mp", "embedding"):
            group = getattr(self, f"{name}_group")
            if group is not None:
                dist.destroy_process_group(group)
                setattr(self, f"{name}_group", None)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Launcher environment --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list, e.g. 'gpu[012-015,020],cpu1' -> 'gpu012'.

    `scontrol show hostnames` would do this, but it is not available inside every container.
    """
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match or not nodelist:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST {nodelist!r}")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def read_launch_env(environ: Optional[dict] = None, default_port: int = 29500) -> LaunchEnv:
    """Where am I in the job? torchrun variables win, then an srun step's, else a single process.

    SLURM variables are trusted only inside a job step (`SLURM_STEP_ID` set): in the batch script's own
    shell `SLURM_NTASKS` is the allocation size, not the number of processes that will join.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", default_port)),
            source="torchrun",
        )
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        # A per-job port keeps two jobs sharing a first node from colliding.
        port = int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=addr,
            master_port=port,
            source="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", default_port, "single")


def write_pid_file(launch: LaunchEnv, environ: Optional[dict] = None) -> Optional[str]:
    """Record this process's PID as `$MEGATRON_PP_PID_DIR/<host>.<local rank>.pid` when that is set.

    The SLURM batch script signals training processes through these files on preemption: neither
    srun's relaying of USR1 nor a torchrun agent (which dies on USR1) can be relied on to reach them.
    Written by `ExitConditions` once its handlers are installed, so that no USR1 meets the default action.
    """
    env = os.environ if environ is None else environ
    directory = env.get("MEGATRON_PP_PID_DIR")
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{socket.gethostname()}.{launch.local_rank}.pid")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)
    return path


def rendezvous_store(launch: LaunchEnv, timeout_s: float = 600.0) -> Optional["dist.Store"]:
    """The job's rendezvous TCPStore (None for a single process): a client of the torchrun agent's
    store, or for a plain launch (srun, a script) one that rank 0 hosts. Made before the arguments are
    checked so that the ranks can agree on a usage error (`training.errors`); `init_distributed` then
    builds the process group on the same store, so one server serves the job."""
    if launch.world_size == 1 and launch.source == "single":
        return None
    store, _, _ = next(dist.rendezvous(
        f"tcp://{launch.master_addr}:{launch.master_port}?rank={launch.rank}&world_size={launch.world_size}",
        timeout=datetime.timedelta(seconds=timeout_s)))
    return store


def init_distributed(
    backend: Optional[str] = None, timeout_s: float = 600.0, environ: Optional[dict] = None,
    store: Optional["dist.Store"] = None,
) -> LaunchEnv:
    """Initialise the default process group from the launcher's environment (on `store`, the job's
    `rendezvous_store`, when the caller already has it).

    A single process with no launcher gets no process group at all (plain `python pretrain_gpt.py`
    works and pays nothing). `backend` defaults to nccl when CUDA is available, else gloo.
    """
    launch = read_launch_env(environ)
    if launch.world_size == 1 and launch.source == "single":
        return launch
    if dist.is_initialized():
        return launch
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank % max(torch.cuda.device_count(), 1))
    if store is None:
        store = rendezvous_store(launch, timeout_s)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return launch
