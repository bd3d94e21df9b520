"""dev/interaction_matrix.py: a larger draw joins arrays without running a case twice, and a run reports each
case's outcome and deviation in its JSON (one case here, the issue-37 bf16 zb-h1 one)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "dev"))
import interaction_matrix  # noqa: E402

from megatron_pp.testing import interaction  # noqa: E402


def test_arrays_from_consecutive_seeds_join_without_repeats(tmp_path):
    one = interaction.covering_array(7, accepts=interaction.accepted(str(tmp_path)))
    joined = interaction_matrix.draw(7, 2, 4, str(tmp_path))
    keys = [tuple(sorted(c.items())) for c in joined]
    assert len(keys) == len(set(keys)) and joined[:len(one)] == one and len(joined) > len(one)


def test_a_run_reports_outcome_and_deviation(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert interaction_matrix.main(["--only", "bf16-zb-h1-tp2pp2dp1v1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["ran"] == report["cases"] >= 1 and report["skipped_pairs"] == 26
    case = report["results"][0]
    assert case["outcome"] == "ran" and case["deviation"]["loss"] < 2e-3
    assert "1 ran, 0 refused, 0 failed" in capsys.readouterr().out
