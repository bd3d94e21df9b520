"""tools/dry_run_table.py: the configurations are the training script's own flags, and bad input is one line."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import dry_run_table  # noqa: E402
from megatron_pp.training.arguments import parse_args  # noqa: E402


def test_every_configuration_passes_the_training_scripts_checks():
    for name in dry_run_table.CONFIGS:
        args = parse_args(dry_run_table.argv_of(name))
        assert args.dry_run == args.tensor_model_parallel_size * args.pipeline_model_parallel_size


def test_an_unknown_configuration_is_one_line_and_exit_2(capsys):
    assert dry_run_table.main(["--configs", "llama3-70b-1f1b,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown configuration 'nope'" in err[0]
