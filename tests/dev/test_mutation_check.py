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
    results = mutation_check.check(str(tmp_path), chosen, timeout=120, log=lambda _: None)
    assert [r["outcome"] for r in results] == ["failed", "survived"]
    assert results[0]["killed_by_suite"] == "test_toy.py::test_limit"
    assert (tmp_path / "toy.py").read_text() == TOY  # the working tree is never touched
    notes = {results[1]["id"]: {"equivalent": "printing changes no number"}}
    summary = mutation_check.report(results, notes, "cmd")
    assert (summary["total"], summary["killed"], summary["equivalent"], summary["non_equivalent"]) == (2, 1, 1, 1)
    assert summary["survivors"][0]["where"] == "toy.py:7" and "equivalent" in summary["survivors"][0]
    assert "unexplained" in mutation_check.report(results, {}, "cmd")["survivors"][0]
    fixed = mutation_check.report(results, {results[1]["id"]: {"fixed": "the print was the bug"}}, "cmd")
    assert (fixed["killed"], fixed["non_equivalent"]) == (1, 2) and "fixed" in fixed["survivors"][0]


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
