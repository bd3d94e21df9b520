"""tools/dry_run_table.py: the configurations are the training script's own flags, and bad input is one line."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import dry_run_table  # noqa: E402
from megatron_pp.planning.verify import planned_from_flags  # noqa: E402
from megatron_pp.training.arguments import parse_args  # noqa: E402


def test_every_configuration_passes_the_training_scripts_checks():
    for name in dry_run_table.CONFIGS:
        args = parse_args(dry_run_table.argv_of(name))
        dp = dry_run_table.DATA_PARALLEL.get(name, 1)
        assert args.dry_run == args.tensor_model_parallel_size * args.pipeline_model_parallel_size * dp


def test_the_planner_plans_every_configuration_as_the_job_runs_it():
    """Every row has a planner column (`planning.verify.planned_from_flags`): dp, zero1 and recomputation as
    the flags say; looped-bfs without --recompute-granularity checkpoints layer inputs, the planner's full."""
    for name in dry_run_table.CONFIGS:
        argv = dry_run_table.argv_of(name)
        job, cluster, c = planned_from_flags(argv, int(argv[argv.index("--dry-run") + 1]))
        assert c.dp == dry_run_table.DATA_PARALLEL.get(name, 1) and cluster.num_gpus == c.tp * c.pp * c.dp
        assert c.distributed_optimizer == ("--use-distributed-optimizer" in argv)
        assert job.optimizer == "fused"  # what the dry run builds by default
    _, _, looped = planned_from_flags(dry_run_table.argv_of("llama3-70b-looped-bfs-layered"), 128)
    assert looped.recompute == "full" and "checkpoint_layer_inputs" not in dict(looped.options)
    _, _, selective = planned_from_flags(dry_run_table.argv_of("llama3-70b-recompute-selective"), 64)
    assert selective.recompute == "selective"


def test_pipeline_ranks_name_tp_0_dp_0_of_each():
    assert dry_run_table.pipeline_ranks_to_global("llama3-70b-1f1b", "0,7") == "0,56"
    # dp 2: a pipeline stage spans tp x dp = 16 ranks
    assert dry_run_table.pipeline_ranks_to_global("llama3-70b-dp2-zero1", "0,7") == "0,112"


def test_a_pipeline_rank_outside_the_job_is_one_line_and_exit_2(capsys):
    assert dry_run_table.main(["--configs", "llama3-70b-1f1b", "--pipeline-ranks", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pipeline-ranks: 8 is not a pipeline rank" in err[0]


def test_an_unknown_configuration_is_one_line_and_exit_2(capsys):
    assert dry_run_table.main(["--configs", "llama3-70b-1f1b,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown configuration 'nope'" in err[0]
