"""dev/render_docs.py: every marked figure in README.md and docs/ agrees with its committed JSON, and a page
that disagrees is named (page, line, renderer), as is a marker naming the wrong JSON or no renderer."""
import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "dev"))

import render_docs  # noqa: E402
from doc_renderers import RENDERERS  # noqa: E402


def test_every_page_agrees_with_its_json():
    assert render_docs.run(ROOT) == []


@pytest.fixture
def copy_of_the_docs(tmp_path):
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs", ignore=shutil.ignore_patterns("img", "papers"))
    return tmp_path


def test_a_planted_disagreement_is_named(copy_of_the_docs, capsys):
    page = copy_of_the_docs / "docs" / "benchmarks.md"
    text = page.read_text()
    row = next(line for line in render_docs.render("split-backward").splitlines()
               if line.startswith("| (BI + BW) / B, wall"))
    planted = row.replace(" | ", " | 0.123 (planted) | ", 1)
    assert text.count(row) == 1
    page.write_text(text.replace(row, planted))
    assert render_docs.main(["--check", "--root", str(copy_of_the_docs)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("docs/benchmarks.md:") and "render split-backward:" in err[0]
    assert "0.123 (planted)" in err[0] and "split_backward_cpu.json" in err[0]
    # --write puts the JSON's figure back, and the copy checks clean again
    assert render_docs.main(["--write", "--root", str(copy_of_the_docs)]) == 0
    assert page.read_text() == text
    assert render_docs.run(str(copy_of_the_docs)) == []


def test_a_changed_json_is_named_on_the_page_that_shows_it(copy_of_the_docs):
    results = copy_of_the_docs / "docs" / "results" / "split_backward_cpu.json"
    data = json.loads(results.read_text())
    data["input_over_whole"] = 0.601
    results.write_text(json.dumps(data))
    problems = render_docs.run(str(copy_of_the_docs))
    assert {p.split(": render ")[1].split(":")[0] for p in problems} == {"split-backward", "split-backward-pair"}
    assert any(p.startswith("docs/schedules.md:") for p in problems)


def test_a_marker_must_name_the_renderers_json_and_a_known_renderer():
    text = ("a <!-- render: split-backward-pair (from docs/results/vs_torch_cpu.json; do not edit by hand) -->x"
            "<!-- end render: split-backward-pair --> b <!-- render: no-such (from docs/results/x.json; do not edit "
            "by hand) -->y<!-- end render: no-such --> c <!-- render: split-backward-pair (from x) -->")
    _, differences, problems = render_docs.render_page(text, "page.md")
    assert differences == []
    assert problems[0] == ("page.md:1: render split-backward-pair: the marker names docs/results/vs_torch_cpu.json, "
                           "the renderer reads docs/results/split_backward_cpu.json")
    assert problems[1].startswith("page.md:1: render no-such: no such renderer")
    assert problems[2].startswith("page.md: 1 render marker(s) without a matching end marker")


def test_every_renderer_reads_a_committed_json_under_docs_results():
    for name, (source, _) in RENDERERS.items():
        for path in render_docs.source_list(source):
            assert path.startswith("docs/results/") and os.path.isfile(os.path.join(ROOT, path)), (name, path)
