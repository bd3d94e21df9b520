"""benchmarks/bench_offload.py on CPU with tiny shapes: a complete report whose k follows from its own measurements,
and full offload that really moved stashes and lowered the resident peak."""
import json
import os
import sys

import pytest

from megatron_pp.schedules.offload import k_from_formula, k_from_measurement, offload_time_from_k

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_offload  # noqa: E402


def test_tiny_cpu_run_writes_a_consistent_report(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--hidden", "64", "--seq", "32", "--stack-hidden", "64", "--stack-seq", "32", "--layers", "3",
            "--microbatches", "4", "--rounds", "1", "--repeats", "1", "--copy-mb", "1", "--json", str(out)]
    assert bench_offload.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"] == "python benchmarks/bench_offload.py " + " ".join(argv)
    assert report["device"].startswith("CPU only") and "not PCIe" in report["bandwidth"]["kind"]
    bandwidth = report["bandwidth"]["d2h_bytes_per_s"]
    (layer,) = report["layers"]
    assert (layer["hidden"], layer["seq"]) == (64, 32) and layer["saved_bytes"] > 0
    assert layer["k_measured"] == pytest.approx(k_from_measurement(layer["saved_bytes"], bandwidth, layer["fb_time_s"]))
    assert layer["k_eq1"] == pytest.approx(k_from_formula(64, 32, layer["achieved_flops"], bandwidth))
    assert layer["full_offload_free"] == (layer["k_measured"] <= 1)
    stack = report["full_offload"]
    assert stack["offload_time"] == pytest.approx(offload_time_from_k(stack["k"]))
    # p = 1, v = 3, m = 4: chunks 0 and 1 of every microbatch move; the last chunk lives too briefly.
    assert stack["offloaded_stashes"] == 8
    assert stack["peak_resident_bytes"]["po-f"] < stack["peak_resident_bytes"]["no offload"]
    compare = report["against_interleaved"]
    rows = compare["schedules"]
    assert compare["baseline"] == "interleaved-1f1b" and set(rows) == {"interleaved-1f1b", "gis-h", "po-h"}
    assert rows["interleaved-1f1b"]["stash_ratio"] == 1.0 and rows["po-h"]["stash_ratio"] < 1.0
    assert all(row["step_ratio"] > 0 and row["peak_device_bytes"] is None for row in rows.values())
