"""dev/mutation_check.py: the mutants it plants, and a run on a toy repository (one killed, one survivor)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "dev"))
import mutation_check  # noqa: E402

TOY = '''"""Docstring with 1 and < that is no code."""


def limit(x: int = 3) -> bool:
    """Also 2 no code."""
    total = x + 1
    print(f"{x + 5}")
    return total < 4 and x >= 0
'''


def test_operators_and_what_is_left_alone():
    mutants = {(m.line, m.col, m.operator): m for m in mutation_check.mutants_of("toy.py", TOY)}
    assert sorted(mutants) == [(4, 19, "int+1"), (4, 19, "int-1"), (6, 4, "drop"), (6, 16, "int+1"),
                               (6, 16, "int-1"), (7, 4, "drop"), (8, 11, "and/or"), (8, 11, "cmp"),
                               (8, 19, "int+1"), (8, 19, "int-1"), (8, 25, "cmp"), (8, 30, "int+1"),
                               (8, 30, "int-1")]
    # Docstrings, annotations and f-strings hold no mutant; each mutant is one small edit.
    assert mutants[8, 11, "cmp"].mutated.strip() == "return total <= 4 and x >= 0"
    assert mutants[8, 25, "cmp"].mutated.strip() == "return total < 4 and x > 0"
    assert mutants[8, 11, "and/or"].mutated.strip() == "return total < 4 or x >= 0"
    assert mutants[6, 4, "drop"].mutated.strip() == "pass"
    assert mutants[4, 19, "int-1"].mutated.strip() == "def limit(x: int = 2) -> bool:"
    assert mutants[8, 30, "int-1"].mutated.strip() == "return total < 4 and x >= (-1)"
    for m in mutants.values():
        mutated = mutation_check.apply(TOY, m)
        compile(mutated, "toy.py", "exec")
        assert mutated.count("\n") <= TOY.count("\n")


def test_run_on_a_toy_repository_reports_killed_and_survivors(tmp_path, monkeypatch):
    (tmp_path / "toy.py").write_text(TOY)
    (tmp_path / "test_toy.py").write_text("from toy import limit\n\n\ndef test_limit():\n"
                                          "    assert limit(2) and not limit(3)\n")
    monkeypatch.setitem(mutation_check.COVERING, "toy.py", ["test_toy.py"])
    by_key = {(m.line, m.col, m.operator): m for m in mutation_check.mutants_of("toy.py", TOY)}
    chosen = [by_key[8, 11, "cmp"], by_key[7, 4, "drop"]]  # the boundary is tested, the print is not
    seen = []  # a partial report after each mutant
    results = mutation_check.check(str(tmp_path), chosen, timeout=120, log=lambda _: None,
                                   on_result=lambda so_far: seen.append(len(so_far)))
    assert [r["outcome"] for r in results] == ["failed", "survived"] and seen == [1, 2]
    assert results[0]["killed_by_suite"] == "test_toy.py::test_limit"
    assert (tmp_path / "toy.py").read_text() == TOY  # the working tree is never touched
    notes = {results[1]["id"]: {"equivalent": "printing changes no number"}}
    summary = mutation_check.report(results, notes, "cmd")
    assert (summary["total"], summary["killed"], summary["equivalent"], summary["non_equivalent"]) == (2, 1, 1, 1)
    assert summary["survivors"][0]["where"] == "toy.py:7" and "equivalent" in summary["survivors"][0]
    assert "unexplained" in mutation_check.report(results, {}, "cmd")["survivors"][0]
    fixed = mutation_check.report(results, {results[1]["id"]: {"fixed": "the print was the bug"}}, "cmd")
    assert (fixed["killed"], fixed["non_equivalent"]) == (1, 2) and "fixed" in fixed["survivors"][0]
    still = mutation_check.report(results, {results[1]["id"]: {"open": "only a GPU runs it"}}, "cmd")
    assert (still["killed"], still["non_equivalent"]) == (1, 2) and still["survivors"][0]["open"] == "only a GPU runs it"


def test_a_mutant_that_breaks_the_import_of_a_test_named_by_node_id_is_killed(tmp_path, monkeypatch):
    """Dropping a module-level assignment makes the module fail to import; with the covering test given
    as a node id pytest then exits 4 ("found no collectors"). That is the suite failing, not a bad map."""
    source = "LIMIT = 3\n\n\ndef limit(x):\n    return x < LIMIT\n"
    (tmp_path / "toy.py").write_text(source)
    (tmp_path / "test_toy.py").write_text("from toy import limit\n\n\ndef test_limit():\n    assert limit(2)\n")
    monkeypatch.setitem(mutation_check.COVERING, "toy.py", ["test_toy.py::test_limit"])
    drop = next(m for m in mutation_check.mutants_of("toy.py", source) if (m.line, m.operator) == (1, "drop"))
    results = mutation_check.check(str(tmp_path), [drop], timeout=120, log=lambda _: None)
    assert results[0]["outcome"] == "failed"
    # A node id that names no test is still the map's error, reported, not counted as a kill.
    monkeypatch.setitem(mutation_check.COVERING, "toy.py", ["test_toy.py::test_missing"])
    with pytest.raises(RuntimeError, match="pytest exited 4"):
        mutation_check.check(str(tmp_path), [drop], timeout=120, log=lambda _: None)


def test_every_module_and_covering_test_exists():
    # A missing path stops a mutation run hours in (pytest cannot collect it), and a test renamed inside its
    # file would leave its module's mutants with fewer tests.
    for module, tests in mutation_check.COVERING.items():
        assert os.path.isfile(os.path.join(ROOT, module)), module
        for test in tests:
            path, _, name = test.partition("::")
            assert os.path.isfile(os.path.join(ROOT, path)), test
            if name:
                with open(os.path.join(ROOT, path)) as f:
                    assert f"def {name.split('[')[0]}(" in f.read(), test


def _git(repo, *args):
    import subprocess

    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_since_plants_mutants_only_on_changed_lines(tmp_path):
    """A toy repository: one commit, then an edit of line 8 and a new line 9; `--since` keeps the mutants
    of those lines only (a rewritten line and an added one), none of the untouched lines 4 and 6."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "toy.py").write_text(TOY)
    _git(tmp_path, "add", "toy.py")
    _git(tmp_path, "commit", "-q", "-m", "toy")
    edited = TOY.replace("return total < 4 and x >= 0", "limit_hit = total < 5 and x >= 0\n    return limit_hit")
    (tmp_path / "toy.py").write_text(edited)
    changed = mutation_check.changed_lines(str(tmp_path), "HEAD")
    assert changed == {"toy.py": {8, 9}}
    kept = mutation_check.on_changed_lines(mutation_check.mutants_of("toy.py", edited), changed)
    assert kept and {m.line for m in kept} == {8}  # line 9 (a bare return of a name) has no mutant
    assert {m.operator for m in kept} == {"drop", "cmp", "and/or", "int+1", "int-1"}
    with pytest.raises(ValueError, match="--since no-such-commit"):
        mutation_check.changed_lines(str(tmp_path), "no-such-commit")


def test_changed_lines_of_a_diff_follow_hunks_renames_and_deletions():
    diff = ("diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -3 +3 @@ x\n-a\n+b\n@@ -10,2 +10,0 @@\n-c\n-d\n"
            "@@ -20,0 +19,3 @@\n+e\n+f\n+g\n"
            "diff --git a/old.py b/new.py\nsimilarity index 90%\nrename from old.py\nrename to new.py\n"
            "--- a/old.py\n+++ b/new.py\n@@ -5 +5 @@\n-h\n+i\n"
            "diff --git a/gone.py b/gone.py\ndeleted file mode 100644\n--- a/gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-j\n")
    assert mutation_check.parse_changed_lines(diff) == {"a.py": {3, 19, 20, 21}, "new.py": {5}}


def test_since_through_the_command_line(capsys):
    """`--list` counts only changed lines' mutants (never more than without --since); an unknown commit is one
    line and exit 2."""
    import re

    def total(argv):
        assert mutation_check.main(argv) == 0
        return int(re.search(r"^\s*(\d+)\s+total$", capsys.readouterr().out, re.MULTILINE).group(1))

    module = ["--modules", "megatron_pp/data/blend.py"]
    assert total(["--since", "HEAD", "--list", *module]) <= total(["--list", *module])
    with pytest.raises(SystemExit) as info:
        mutation_check.main(["--since", "no-such-commit-here", "--list", *module])
    assert info.value.code == 2 and "--since no-such-commit-here" in capsys.readouterr().err


def test_the_committed_tree_leaves_out_what_is_not_committed(tmp_path):
    """Others edit the checkout while a run goes on: by default mutants are planted in HEAD as committed,
    extracted at the start, and `--since` counts the lines changed up to that commit, not the working tree's."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "toy.py").write_text(TOY)
    _git(repo, "add", "toy.py")
    _git(repo, "commit", "-q", "-m", "toy")
    base = TOY.replace("total = x + 1", "total = x + 2")
    (repo / "toy.py").write_text(base)
    _git(repo, "commit", "-q", "-am", "edit line 6")
    (repo / "toy.py").write_text(base.replace("return total < 4", "return total < 7"))  # someone's unfinished edit
    (repo / "scratch.py").write_text("x = 1\n")  # and an untracked file
    tree, sha = mutation_check.committed_tree(str(repo), str(tmp_path / "out"))
    assert sorted(os.listdir(tree)) == ["toy.py"]
    assert open(os.path.join(tree, "toy.py")).read() == base
    assert len(sha) == 40
    assert mutation_check.changed_lines(str(repo), "HEAD~1", sha) == {"toy.py": {6}}
    assert mutation_check.changed_lines(str(repo), "HEAD~1") == {"toy.py": {6, 8}}  # the working tree's view
    with pytest.raises(ValueError, match="no-such-commit"):
        mutation_check.committed_tree(str(repo), str(tmp_path / "out2"), "no-such-commit")


def test_a_run_stopped_early_leaves_a_partial_report_that_says_what_it_mutated(tmp_path, monkeypatch, capsys):
    """The report is rewritten after every mutant, so a `--since` run stopped early (a session's time limit)
    still says which commit it mutated and since when, as the finished one does, marked `partial`."""
    import json
    import re

    snapshots = []

    def two_mutants_then_stop(root, mutants, timeout, log=print, on_result=None):
        results = []
        for mutant, outcome in zip(mutants, ("failed", "survived")):
            results.append({**mutation_check._describe(mutant), "outcome": outcome,
                            "killed_by_suite": "t.py::t" if outcome == "failed" else None, "seconds": 1.0})
            on_result(results)
            snapshots.append(json.loads(out.read_text()))
        raise KeyboardInterrupt

    out = tmp_path / "report.json"
    monkeypatch.setattr(mutation_check, "check", two_mutants_then_stop)
    with pytest.raises(KeyboardInterrupt):
        mutation_check.main(["--since", "9821f81", "--modules", "megatron_pp/training/batch_ramp.py",
                             "--sample", "3", "--seed", "1", "--out", str(out)])
    first, second = snapshots
    assert (first["partial"], second["partial"]) == ("1 of 3", "2 of 3")
    assert (second["total"], second["killed"], len(second["survivors"])) == (2, 1, 1)
    assert second["since"] == "9821f81" and len(second["at"]) == 40 and isinstance(second["changed_unmapped"], list)
    # And what the sample was drawn from: `--list`'s count of the module's mutants on the changed lines.
    listed = mutation_check.main(["--since", "9821f81", "--modules", "megatron_pp/training/batch_ramp.py", "--list"])
    total = int(re.search(r"^\s*(\d+)\s+total$", capsys.readouterr().out, re.MULTILINE).group(1))
    assert listed == 0 and second["population"] == {"mutants": total, "modules": 1}
