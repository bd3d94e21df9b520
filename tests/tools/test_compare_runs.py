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
