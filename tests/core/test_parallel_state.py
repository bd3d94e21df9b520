"""Rank math golden tables, launcher-environment parsing, and group construction on real gloo worlds."""
import pytest
import torch.distributed as dist

from megatron_pp.core.parallel_state import LayoutError, RankLayout, first_host, read_launch_env
from tests.dist import run_distributed


def test_golden_16_ranks_tp2_pp4():
    layout = RankLayout(16, tp=2, pp=4)
    assert layout.dp == 2
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.pp_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.mp_groups() == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert layout.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_golden_8_ranks_tp1_pp2():
    layout = RankLayout(8, tp=1, pp=2)
    assert layout.dp == 4
    assert layout.tp_groups() == [[r] for r in range(8)]
    assert layout.dp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_golden_4_ranks_tp4_and_pp4():
    assert RankLayout(4, tp=4).tp_groups() == [[0, 1, 2, 3]]
    assert RankLayout(4, tp=4).dp_groups() == [[0], [1], [2], [3]]
    pp = RankLayout(4, pp=4)
    assert pp.pp_groups() == [[0, 1, 2, 3]]
    assert pp.embedding_groups() == [[0, 3]]
    assert RankLayout(1).embedding_groups() == [[0]]


@pytest.mark.parametrize("world,tp,pp", [(16, 2, 4), (8, 1, 2), (12, 3, 2), (24, 2, 3), (1, 1, 1)])
def test_coords_round_trip_and_partition(world, tp, pp):
    layout = RankLayout(world, tp, pp)
    for rank in range(world):
        c = layout.coords(rank)
        assert layout.rank(c.tp, c.dp, c.pp) == rank
    for name, groups in layout.all_groups().items():
        if name == "embedding":
            continue
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), name  # every kind of group partitions the world


@pytest.mark.parametrize(
    "world,tp,pp,flag",
    [(6, 4, 1, "--tensor-model-parallel-size 4"), (8, 1, 3, "--pipeline-model-parallel-size 3"), (4, 0, 1, "must be >= 1")],
)
def test_bad_layouts(world, tp, pp, flag):
    with pytest.raises(LayoutError, match=flag) as info:
        RankLayout(world, tp, pp)
    assert "\n" not in str(info.value)


def test_first_host():
    assert first_host("gpu[012-015,020],cpu1") == "gpu012"
    assert first_host("node7") == "node7"
    assert first_host("a-b[3,5]") == "a-b3"


def test_launch_env_precedence():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    slurm_step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                  "SLURM_JOB_NODELIST": "gpu[010-013]", "SLURM_JOB_ID": "777"}
    env = read_launch_env({**torchrun, **slurm_step})
    assert (env.source, env.rank, env.world_size, env.local_rank, env.master_port) == ("torchrun", 3, 8, 1, 1234)
    env = read_launch_env(slurm_step)
    assert (env.source, env.rank, env.world_size, env.local_rank, env.master_addr) == ("slurm", 5, 16, 1, "gpu010")
    batch_shell = {k: v for k, v in slurm_step.items() if k != "SLURM_STEP_ID"}
    env = read_launch_env(batch_shell)  # the sbatch shell's SLURM_NTASKS is the allocation, not a world
    assert (env.source, env.world_size) == ("single", 1)


def _build_groups(ctx, tp, pp):
    state = ctx.parallel_state(tp, pp)
    members = {}
    for name in ("tp", "dp", "pp", "mp", "embedding"):
        group = getattr(state, f"{name}_group")
        members[name] = None if group is None else sorted(dist.get_process_group_ranks(group))
    return state.coords, members, state.pp_ranks


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 4), (4, 1)])
def test_groups_on_gloo(tp, pp):
    layout = RankLayout(4, tp, pp)
    results = run_distributed(4, _build_groups, tp, pp)
    for rank, (coords, members, pp_ranks) in enumerate(results):
        assert coords == layout.coords(rank)
        for name, groups in layout.all_groups().items():
            expected = [g for g in groups if rank in g]
            assert members[name] == (expected[0] if expected else None), (rank, name)
        assert pp_ranks == [g for g in layout.pp_groups() if rank in g][0]


def test_pid_file_for_the_slurm_signal_forwarder(tmp_path):
    import os
    import socket

    from megatron_pp.core.parallel_state import LaunchEnv, write_pid_file

    launch = LaunchEnv(rank=5, world_size=8, local_rank=1, master_addr="h", master_port=1, source="slurm")
    assert write_pid_file(launch, {}) is None
    path = write_pid_file(launch, {"MEGATRON_PP_PID_DIR": str(tmp_path / "pids")})
    assert path == str(tmp_path / "pids" / f"{socket.gethostname()}.1.pid")
    assert open(path).read().strip() == str(os.getpid())
