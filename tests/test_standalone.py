"""The repository stands alone: no tracked file points a reader at a document that is not in it (the design
notes the project was planned from, or a sibling directory of the checkout). What the code takes from the
literature is in docs/ or cited by paper (docs/schedules.md, "Formulas and their sources")."""
from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Built from pieces so that this file does not match itself.
FORBIDDEN = re.compile("|".join(re.escape(p) for p in (
    "SCHEDULES" + ".md", "ARCHITECTURE" + ".md", "STYLE" + ".md", "shared" + "/spec", "../" + "shared")))


def _tracked_files() -> list[str]:
    """`git ls-files`, or every file outside hidden and cache directories where git is not available."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for top, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__" and not d.endswith(".egg-info")]
            found += [os.path.relpath(os.path.join(top, f), ROOT) for f in files]
        return found


def offending_lines(path: str, text: str) -> list[str]:
    return [f"{path}:{number}: {line.strip()[:100]}"
            for number, line in enumerate(text.splitlines(), 1) if FORBIDDEN.search(line)]


def test_the_check_sees_each_kind_of_reference():
    for reference in ("SCHEDULES" + ".md §2", "see ARCHITECTURE" + ".md", "STYLE" + ".md",
                      "notes/shared" + "/spec/x", "../" + "shared/notes"):
        assert offending_lines("x.py", f"ok\n# {reference}\n") == [f"x.py:2: # {reference}"]
    assert offending_lines("x.py", "arXiv 2503.01328, §3; docs/schedules.md\n") == []


def test_no_tracked_file_cites_a_document_outside_the_repository():
    offenders = []
    for path in _tracked_files():
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):  # deleted in the working tree
            continue
        with open(full, "rb") as f:
            offenders += offending_lines(path, f.read().decode("utf-8", errors="replace"))
    assert not offenders, "cite the paper or docs/ instead:\n" + "\n".join(offenders)
