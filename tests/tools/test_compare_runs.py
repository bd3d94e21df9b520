"""tools/compare_runs.py: identical runs pass the assertions, a changed loss curve or a slowdown fails."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import compare_runs  # noqa: E402


def _write(path, losses, step=0.1, eval_rows=False):
    with open(path, "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"iteration": i, "loss": loss, "step_time_s": step, "tokens_per_s": 1000 / step,
                                "peak_stash_bytes": [2**20 * 3, 2**20]}) + "\n")
            if eval_rows:
                f.write(json.dumps({"iteration": i, "eval_loss": loss + 1}) + "\n")
    return str(path)


def test_identical_runs_pass_and_changed_curve_fails(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [6.0, 5.0, 4.0, 3.5], eval_rows=True)
    b = _write(tmp_path / "b.jsonl", [6.0, 5.0, 4.0, 3.5])
    assert compare_runs.main([a, b, "--assert-equal-loss", "--max-slowdown", "0.05"]) == 0
    c = _write(tmp_path / "c.jsonl", [6.0, 5.0, 4.0001, 3.5])
    assert compare_runs.main([a, c, "--assert-equal-loss", "--rtol", "1e-5"]) == 1
    err = capsys.readouterr().err
    assert "at iteration 3" in err and "--rtol" in err
    assert compare_runs.main([a, c, "--assert-equal-loss", "--rtol", "1e-4"]) == 0  # 2.5e-5 relative


def test_slowdown_table_and_plot(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [6.0, 5.0, 4.0], step=0.10)
    b = _write(tmp_path / "b.jsonl", [6.0, 5.0, 4.0], step=0.11)
    png, js = tmp_path / "cmp.png", tmp_path / "cmp.json"
    assert compare_runs.main([a, b, "--labels", "ref", "new", "--max-slowdown", "0.05", "--plot", str(png),
                              "--json", str(js)]) == 1
    assert "median step time 1.100x ref's" in capsys.readouterr().err
    table = json.loads(js.read_text())
    assert [r["label"] for r in table] == ["ref", "new"]
    assert table[1]["step_time_ratio"] == pytest.approx(1.1)
    assert table[0]["peak_stash_mb"] == [3.0, 1.0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1, "loss": 3}\nnot json\n')
    good = _write(tmp_path / "g.jsonl", [1.0])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compare_runs.py"), good, str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "bad.jsonl:2: not JSON" in proc.stderr
    assert compare_runs.main([good, str(tmp_path / "missing.jsonl")]) == 2


def test_tensorboard_directories_ours_and_megatron_lms_compare_with_a_metrics_file(tmp_path, capsys):
    """A TensorBoard directory is a run too: ours (written by MetricsLogger) and one with Megatron-LM's
    scalar names (written with torch's SummaryWriter as Megatron-LM's training loop does)."""
    import io

    from torch.utils.tensorboard import SummaryWriter

    from megatron_pp.training.metrics import MetricsLogger

    losses = [6.0, 5.0, 4.0, 3.5]
    reference = _write(tmp_path / "ref.jsonl", losses, step=0.125)
    ours = tmp_path / "ours"
    logger = MetricsLogger(train_iters=4, log_interval=100, log_throughput=False, tensorboard_dir=str(ours),
                           stream=io.StringIO())
    for line in open(reference):
        row = json.loads(line)
        logger.train({**row, "consumed_samples": 8 * row["iteration"], "lr": 1e-3, "grad_norm": 1.0,
                      "global_batch_size": 8, "loss_scale": 1.0, "skipped": False})
    logger.evaluation({"iteration": 4, "consumed_samples": 32, "eval_loss": 3.6, "eval_ppl": 36.6})
    logger.close()
    megatron = tmp_path / "megatron"
    writer = SummaryWriter(str(megatron))
    for it, loss in enumerate(losses, 1):
        for name, value in (("lm loss", loss), ("iteration-time", 0.125), ("learning-rate", 1e-3),
                            ("grad-norm", 1.0), ("batch-size", 8), ("throughput", 10.0)):
            writer.add_scalar(name, value, it)
        writer.add_scalar("lm loss vs samples", loss, 8 * it)  # another step axis: must not become rows
    writer.add_scalar("lm loss validation", 3.6, 4)
    writer.close()

    js = tmp_path / "cmp.json"
    assert compare_runs.main([reference, str(ours), str(megatron), "--assert-equal-loss", "--rtol", "0",
                              "--max-slowdown", "0", "--json", str(js)]) == 0, capsys.readouterr().err
    table = json.loads(js.read_text())
    assert [r["iterations"] for r in table] == [4, 4, 4] and [r["common_iterations"] for r in table] == [4, 4, 4]
    assert table[1]["peak_stash_mb"] == [3.0, 1.0] and table[2]["peak_stash_mb"] == []
    assert table[1]["tokens_per_s_median"] == pytest.approx(8000.0) and table[2]["step_time_ratio"] == 1.0
    shifted = tmp_path / "shifted"
    writer = SummaryWriter(str(shifted))
    for it, loss in enumerate(losses, 1):
        writer.add_scalar("lm loss", loss + (0.01 if it == 3 else 0), it)
    writer.close()
    assert compare_runs.main([reference, str(shifted), "--assert-equal-loss"]) == 1
    assert "at iteration 3" in capsys.readouterr().err
    assert compare_runs.main([reference, str(tmp_path)]) == 2  # neither metrics.jsonl nor events
    assert "no TensorBoard events" in capsys.readouterr().err
