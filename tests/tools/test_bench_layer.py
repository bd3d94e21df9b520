"""tools/bench_layer.py on CPU with tiny shapes: a valid report with every field, measured stash bytes equal
to planning.memory's prediction, and a file the estimator reads."""
import json
import os
import sys

import pytest

from megatron_pp.models.presets import get_preset
from megatron_pp.planning.bpipe_estimator import Job, efficiency_model
from megatron_pp.planning.efficiency import A100_80GB, BENCH_FORMAT, LayerShape, MeasuredCurve, tp_communication_s

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_layer  # noqa: E402
import estimate_bpipe  # noqa: E402

ROW_FIELDS = {"backend", "micro_batch_size", "forward_ms", "backward_ms", "core_forward_ms", "forward_flops",
              "backward_flops", "core_forward_flops", "achieved_tflops", "mfu", "stash_bytes", "stash_bytes_predicted"}


@pytest.mark.parametrize("preset,tp", [("gpt-tiny", 1), ("llama-tiny", 2)])
def test_tiny_cpu_run_writes_a_complete_report(preset, tp, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--model-preset", preset, "--tp", str(tp), "--micro-batch-sizes", "1", "2", "--repeats", "1",
            "--warmup", "0", "--device", "cpu", "--out", str(out)]
    assert bench_layer.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["format"] == BENCH_FORMAT and report["command"] == "python tools/bench_layer.py " + " ".join(argv)
    assert {"date", "device", "dtype", "peak_tflops", "model_preset", "layer", "warmup", "repeats"} <= report.keys()
    assert report["device"]["type"] == "cpu" and report["dtype"] == "float32" and report["peak_tflops"] is None
    shape = LayerShape(**report["layer"])
    assert shape == LayerShape.from_config(get_preset(preset), tp)
    rows = report["results"]
    assert sorted((r["backend"], r["micro_batch_size"]) for r in rows) == [
        ("reference", 1), ("reference", 2), ("sdpa", 1), ("sdpa", 2)]
    for r in rows:
        assert set(r) == ROW_FIELDS
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["core_forward_ms"] > 0
        assert r["forward_flops"] == shape.forward_model_flops(r["micro_batch_size"])
        assert r["backward_flops"] == 2 * r["forward_flops"] and r["mfu"] is None
        assert r["achieved_tflops"] == pytest.approx(
            3 * r["forward_flops"] / ((r["forward_ms"] + r["backward_ms"]) / 1e3) / 1e12)
        assert r["stash_bytes"] == r["stash_bytes_predicted"] > 0  # the CPU_FP32 formula, byte for byte
    assert "reference" in capsys.readouterr().out

    # The estimator reads it (and says a CPU curve is no guide to a GPU).
    curve = MeasuredCurve.from_file(str(out), shape, "unfused", A100_80GB)
    assert curve.backend == "reference" and any("measured on cpu" in w for w in curve.warnings)
    ref1 = next(r for r in rows if r["backend"] == "reference" and r["micro_batch_size"] == 1)
    # Measured single-GPU time plus the modelled tensor-parallel all-reduces the benchmark cannot see.
    comm = tp_communication_s(shape, 1, A100_80GB)
    assert (comm > 0) == (tp > 1)
    assert curve.layer_times(1).forward_s == pytest.approx(ref1["forward_ms"] / 1e3 + comm)


def test_estimator_cli_uses_the_file(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_layer.main(["--micro-batch-sizes", "1", "2", "--repeats", "1", "--warmup", "0", "--device", "cpu",
                             "--backends", "sdpa", "--out", str(out)]) == 0
    capsys.readouterr()
    assert estimate_bpipe.main(["--model-preset", "gpt-tiny", "--pp", "2", "--global-batch-size", "8",
                                "--attention-backend", "sdpa", "--efficiency-file", str(out),
                                "--max-micro-batch-size", "2"]) == 0
    text = capsys.readouterr().out
    assert f"measured sdpa layer times from {out} (b = 1, 2)" in text and "warning:" in text
    job = Job(get_preset("gpt-tiny"), 1, 2, 1, 8, "unfused")
    with pytest.raises(ValueError, match="no measurement for unfused"):
        efficiency_model(job, A100_80GB, str(out))


def test_bad_input_exits_2(tmp_path, capsys):
    out = str(tmp_path / "x.json")
    assert bench_layer.main(["--device", "cpu", "--backends", "flash", "--out", out]) == 2
    assert "not available on cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench_layer.main(["--micro-batch-sizes", "0", "--out", out])
    assert exit_info.value.code == 2
    assert not os.path.exists(out)
