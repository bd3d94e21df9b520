"""benchmarks/bench_schedules.py on a tiny CPU run: every field, for gpipe, 1f1b and interleaved."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_schedules  # noqa: E402


def test_tiny_cpu_run_reports_every_field(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert bench_schedules.main(["--pp", "2", "--microbatches", "4", "--chunks", "2", "--rounds", "1",
                                 "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
                                 "--seq-length", "16", "--vocab-size", "128", "--json", str(out),
                                 "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["pp"] == 2
    assert set(report["schedules"]) == {"gpipe", "1f1b", "interleaved-1f1b"}
    for name, r in report["schedules"].items():
        assert r["step_time_s_median"] > 0 and r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0
        assert r["mfu"] is None  # no device peak on CPU: never a made-up MFU
        assert 0 < r["bubble_simulated"] < 1 and 0 <= r["bubble_measured"] < 1
        assert len(r["peak_stash_bytes_per_rank"]) == 2 and all(b > 0 for b in r["peak_stash_bytes_per_rank"])
        assert r["ratio_to_ideal_median"] > 0 and len(r["cpu_s_per_rank_median"]) == 2
    # GPipe holds all m stashes on every rank; 1F1B rank 0 only p of them (bytes, same model).
    assert report["schedules"]["gpipe"]["peak_stash_bytes_per_rank"][0] > report["schedules"]["1f1b"]["peak_stash_bytes_per_rank"][0]
    assert "bubble sim" in capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG"
