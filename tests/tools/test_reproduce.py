"""tools/reproduce.py: every paper's --quick run produces its rows on CPU in under a minute and they are
the rows docs/reproduction.md records (the --check of the cells it computes: CI's run of the check), the
check names a cell that disagrees, and the small-scale memory predictions match the executor's measured
stash peaks within 5%."""
import os
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from megatron_pp.planning import reproduce as rp  # noqa: E402
from megatron_pp.planning.efficiency import HARDWARE_PROFILES  # noqa: E402
from megatron_pp.planning.papers.common import load_hardware_profile, relative_error  # noqa: E402
from megatron_pp.planning.reproduce import DOCUMENT, check_document, document_tables  # noqa: E402
from megatron_pp.planning.papers.small import predicted_stash_peaks, tiny_config  # noqa: E402

HARDWARE = ("a100-80gb", "v100-16gb-p3.16xlarge", "h100-sxm", "h200")


@pytest.fixture(scope="module")
def small():
    pool = rp.SmallScale()
    yield pool
    pool.close()


@pytest.mark.parametrize("name", HARDWARE)
def test_hardware_profiles_cite_every_number(name):
    profile, raw = load_hardware_profile(name, "fp16")
    numbers = [k for k, v in raw.items() if k not in ("name", "sources") and v is not None]
    assert set(numbers) <= set(raw["sources"]), "every number needs a source"
    assert profile.peak_tflops > 0 and 0 < profile.matmul_efficiency <= 1 and profile.gpus_per_node == 8
    assert raw["pcie_gbps"] > 0


@pytest.mark.parametrize("name", HARDWARE)
def test_matmul_efficiency_has_one_home(name, tmp_path):
    """The planner's built-in profile is the only home of a GPU's achieved efficiency: the YAML the paper
    reproductions read carries none for it, loading gives the planner's value and source, and a YAML that
    adds its own is refused. Numbers both files carry must agree."""
    path = os.path.join(ROOT, "launch", "hardware", name + ".yaml")
    with open(path) as f:
        raw = yaml.safe_load(f)
    builtin = next((p for p in HARDWARE_PROFILES.values() if p.name == raw["name"]), None)
    profile, _ = load_hardware_profile(name, "fp16")
    if builtin is None:
        assert "matmul_efficiency" in raw  # a GPU the planner does not know keeps its own (V100: 2BW's figure)
        return
    assert "matmul_efficiency" not in raw and "matmul_efficiency" not in raw["sources"]
    assert profile.matmul_efficiency == builtin.matmul_efficiency
    assert profile.sources["matmul_efficiency"] == builtin.sources["matmul_efficiency"]
    for field in ("peak_tflops", "memory_gib", "hbm_gbps", "tp_link_gbps", "pair_link_gbps", "gpus_per_node"):
        assert getattr(profile, field) == getattr(builtin, field), field
    drifted = tmp_path / "drifted.yaml"
    drifted.write_text(yaml.safe_dump({**raw, "matmul_efficiency": 0.5,
                                       "sources": {**raw["sources"], "matmul_efficiency": "a second home"}}))
    with pytest.raises(ValueError, match="lives in megatron_pp/planning/efficiency.py"):
        load_hardware_profile(str(drifted), "fp16")


def test_v100_has_no_bf16_peak():
    with pytest.raises(ValueError, match="no peak_bf16_tflops"):
        load_hardware_profile("v100-16gb-p3.16xlarge", "bf16")


def test_relative_error_of_points_and_ranges():
    assert relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert relative_error(1.5, (1.25, 2.17)) == 0.0
    assert relative_error(1.0, (1.25, 2.17)) == pytest.approx(-0.2)
    assert relative_error(None, 1.0) is None


@pytest.mark.parametrize("paper", rp.PAPERS)
def test_quick_run_produces_rows(paper, small):
    # How long --quick takes is a benchmark's figure, not a test's bound (it depends on the machine's load).
    report = rp.reproduce(paper, quick=True, small=small)
    assert report.rows and report.trends
    text = report.format()
    assert "| Claim | Published | Predicted | Error |" in text and "Small-scale trend" in text
    # Every row shows a published figure or says why there is none.
    assert all(r.published for r in report.rows)
    memory = [t for t in report.trends if "peak stash per rank" in t.trend]
    for trend in memory:
        assert trend.error is not None and abs(trend.error) <= 0.05, trend
    # The document records what the code computes (the full table: `tools/reproduce.py all --check`).
    assert check_document(report, document_tables(), complete=False) == []


def test_check_names_the_cell_that_disagrees(tmp_path, capsys):
    """`--check` passes on the recorded document and names the paper, claim and column of an edited cell."""
    import reproduce as tool

    assert tool.main(["2bw", "--check"]) == 0
    report = rp.reproduce("2bw", measure=False)
    claim, _, predicted, _ = report.row_cells()[0]
    text = open(DOCUMENT).read()
    row = next(line for line in text.splitlines() if line.startswith(f"| {claim} |"))
    edited = tmp_path / "reproduction.md"
    edited.write_text(text.replace(row, row.replace(f"| {predicted} |", "| 9.99× |", 1)))
    problems = check_document(report, document_tables(str(edited)))
    assert problems == [f"docs/reproduction.md, 2bw: row {claim!r}, column Predicted: the document says '9.99×', "
                        f"the code computes {predicted!r}"]
    edited.write_text(text.replace(row + "\n", ""))
    assert any("is missing" in p and claim in p for p in check_document(report, document_tables(str(edited))))


def test_small_scale_memory_matches_measured_within_5_percent(small):
    cfg = tiny_config()
    for name, v, options in (("1f1b", 1, {}), ("bpipe", 1, {"bpipe_max_resident": 2}), ("gis-h", 2, {}),
                             ("po-f", 2, {})):
        measured = [r["peak_stash_bytes"] for r in small.run(cfg, name, 4, 8, v, options, 1)]
        predicted = predicted_stash_peaks(cfg, name, 4, 8, v, options, 1)
        for got, want in zip(predicted, measured):
            assert got == pytest.approx(want, rel=0.05), (name, predicted, measured)


def test_tool_prints_the_table(capsys):
    import reproduce as tool

    assert tool.main(["2bw", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "2BW / PipeDream-Flush throughput" in out and "up to 1.6×" in out


def test_bad_options_are_one_line_errors(capsys):
    import reproduce as tool

    assert tool.main(["bpipe", "--no-measure", "--hardware", "nope"]) == 2
    assert tool.main(["2bw", "--no-measure", "--efficiency-file", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "unknown hardware profile 'nope'; known: a100-80gb" in err and "applies to bpipe" in err
    assert err.count("\n") == 2
