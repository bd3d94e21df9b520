"""tools/schedule_matrix.py: docs/schedules.md's compatibility matrix equals what the code accepts (the CI
check), a stale cell or a missing test is reported in one line, and a plugin schedule is judged like a
built-in one."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import schedule_matrix  # noqa: E402


def test_document_matches_the_code():
    # A fresh process: schedules other tests register in this one must not add rows.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "schedule_matrix.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def generated():
    return schedule_matrix.render(*schedule_matrix.matrix())


def test_known_refusals_and_acceptances(generated):
    cells = schedule_matrix._table(generated)
    assert cells[("`2bw`", "distributed optimizer")].startswith("no (")
    assert cells[("`gpipe`", "virtual stages (v = 2)")].startswith("no (")
    assert cells[("`looped-bfs` / `modular`", "layered grad accumulation")] == "yes"
    assert cells[("`bpipe`", "distributed optimizer")] == "yes"
    assert "2bw keeps whole fp32 main weights" not in generated  # the schedule's name is generalised
    assert "NAME keeps whole fp32 main weights and gradients per stage" in generated


def test_stale_cell_is_reported_in_one_line(tmp_path, generated, capsys, monkeypatch):
    doc = (tmp_path / "schedules.md")
    stale = generated.replace("| `2bw` | no (1) |", "| `2bw` | yes |", 1)
    assert stale != generated
    refusals = f"{schedule_matrix.REFUSALS_BEGIN}\n{schedule_matrix.render_refusals([])}{schedule_matrix.REFUSALS_END}\n"
    doc.write_text(f"intro\n{schedule_matrix.BEGIN}\n{stale}{schedule_matrix.END}\n{refusals}after\n")
    monkeypatch.setattr(schedule_matrix, "matrix", lambda: _rows_of(generated))
    monkeypatch.setattr(schedule_matrix, "interaction_refusals", lambda: [])
    assert schedule_matrix.main(["--check", "--doc", str(doc)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 cell(s) differ" in err[0] and "`2bw` x virtual stages (v = 2)" in err[0], err
    assert schedule_matrix.main(["--write", "--doc", str(doc)]) == 0
    assert schedule_matrix.main(["--check", "--doc", str(doc)]) == 0
    assert doc.read_text().startswith("intro\n") and doc.read_text().endswith("after\n")


def _rows_of(block: str):
    """Invert `render` for the test: labels and refusal lines from a rendered block."""
    notes = {f"no ({line.split('. ', 1)[0]})": line.split(". ", 1)[1]
             for line in block.splitlines() if line[:1].isdigit()}
    rows = [line.strip("|").split("|") for line in block.splitlines()[2:] if line.startswith("|")]
    return ([r[0].strip() for r in rows],
            [[None if c.strip() == "yes" else notes[c.strip()] for c in r[1:]] for r in rows])


def test_missing_markers_or_tests_are_reported(tmp_path, capsys):
    doc = tmp_path / "schedules.md"
    doc.write_text("no markers\n")
    assert schedule_matrix.main(["--check", "--doc", str(doc)]) == 2
    assert "no matrix markers" in capsys.readouterr().err
    text = "see `tests/tools/test_schedule_matrix.py::test_nothing_like_this` and tests/nowhere/test_x.py"
    assert schedule_matrix.missing_tests(text) == ["tests/nowhere/test_x.py",
                                                    "tests/tools/test_schedule_matrix.py::test_nothing_like_this"]
    assert schedule_matrix.missing_tests("`tests/tools/test_schedule_matrix.py::test_document_matches_the_code`") == []


def test_a_plugin_schedule_gets_the_row_of_what_it_builds():
    from megatron_pp.schedules.generators import gpipe
    from megatron_pp.schedules.registry import register_schedule, unregister_schedule

    register_schedule("plugin-gpipe", gpipe, supports_virtual=False, description="gpipe under another name")
    try:
        labels, cells = schedule_matrix.matrix()
    finally:
        unregister_schedule("plugin-gpipe")
    rows = dict(zip(labels, cells))
    assert rows["`plugin-gpipe`"] == rows["`gpipe`"]


def test_interaction_refusals_are_listed_and_a_stale_list_is_one_line(tmp_path, generated, capsys, monkeypatch):
    """The interaction matrix's refused cases (megatron_pp/testing/interaction.py) are a second generated block:
    each names its case and the refusal line (no temporary or machine paths); a missing row fails --check."""
    refused = schedule_matrix.interaction_refusals()
    assert refused and all("2bw" in name and "zero1" in name for name, _ in refused)
    assert all("--use-distributed-optimizer" in line and "/tmp" not in line for _, line in refused)
    block = schedule_matrix.render_refusals(refused)
    doc = tmp_path / "schedules.md"
    doc.write_text(f"{schedule_matrix.BEGIN}\n{generated}{schedule_matrix.END}\n"
                   f"{schedule_matrix.REFUSALS_BEGIN}\n{block}{schedule_matrix.REFUSALS_END}\n")
    monkeypatch.setattr(schedule_matrix, "matrix", lambda: _rows_of(generated))
    monkeypatch.setattr(schedule_matrix, "interaction_refusals", lambda: refused)
    assert schedule_matrix.main(["--check", "--doc", str(doc)]) == 0
    doc.write_text(doc.read_text().replace(block.splitlines()[-1] + "\n", ""))
    assert schedule_matrix.main(["--check", "--doc", str(doc)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interaction-matrix refusals are stale (1 row(s) differ" in err[0], err
