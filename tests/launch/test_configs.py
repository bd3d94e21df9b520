"""Every paper-reproduction config in launch/configs/ validates for its full-size layout and for its CPU
scale-down, and the tiny scale really trains."""
import glob
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import launch_config  # noqa: E402

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "launch", "configs", "*.yaml")))


def test_there_are_configs_for_the_papers():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {"pipeoffload_10.5b.yaml", "pipeoffload_42.9b.yaml", "bpipe_gpt3_96b.yaml", "bpipe_gpt3_134b.yaml",
            "bpipe_reeval_gpt3.yaml", "bpipe_reeval_llama.yaml", "pipedream_2bw_gpt_2.2b.yaml",
            "pipedream_2bw_gpt_3.8b.yaml", "pipedream_2bw_gpt_2.2b_1node.yaml", "breadth_first_52b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_full_and_tiny_scale_validate(path, capsys):
    config = launch_config.load_config(path)
    assert config.assumed and config.reproduces and config.variants
    assert launch_config.main([path, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert sum(line.startswith("sbatch ") for line in out.splitlines()) == len(config.variants)
    assert f"--nodes={config.nodes}" in out
    assert launch_config.main([path, "--dry-run", "--scale", "tiny"]) == 0, capsys.readouterr().err


def test_tiny_scale_trains(capsys):
    path = os.path.join(ROOT, "launch", "configs", "pipeoffload_10.5b.yaml")
    assert launch_config.main([path, "--scale", "tiny", "--variant", "po-f", "--set", "train-iters=2"]) == 0


# A real tiny run of the two paper methods whose runtime paths the run above does not touch: BPipe's peer
# store and looped-bfs with layered accumulation and sharded weights (2BW trains in tests/training). Every tiny
# variant of every config is validated by test_full_and_tiny_scale_validate; one iteration keeps each torchrun
# launch short.
TINY_RUNS = [("bpipe_gpt3_96b.yaml", "bpipe"), ("breadth_first_52b.yaml", "looped-bfs")]


@pytest.mark.parametrize("name,variant", TINY_RUNS, ids=[n for n, _ in TINY_RUNS])
def test_paper_method_trains_at_tiny_scale(name, variant, capsys):
    path = os.path.join(ROOT, "launch", "configs", name)
    assert launch_config.main([path, "--scale", "tiny", "--variant", variant, "--set", "train-iters=1"]) == 0


def test_bad_input_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("paper: x\nscript: pretrain_gpt.py\nsurprise: 1\n")
    assert launch_config.main([str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "missing keys" in err and "unknown keys surprise" in err and err.count("\n") == 1
    path = os.path.join(ROOT, "launch", "configs", "pipeoffload_10.5b.yaml")
    assert launch_config.main([path, "--dry-run", "--set", "pipeline-model-parallel-size=3"]) == 2
    assert "--pipeline-model-parallel-size 3" in capsys.readouterr().err
