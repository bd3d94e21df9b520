"""Render every measured or computed figure in README.md and docs/ from its committed JSON, or check that it is.

    python dev/render_docs.py --check      # exit 1, naming page, line and renderer, where a page disagrees
    python dev/render_docs.py --write      # rewrite the text between the markers from the JSON

A figure in a page sits between two markers, on lines of their own for a table or a paragraph:

    <!-- render: split-backward (from docs/results/split_backward_cpu.json; do not edit by hand) -->
    | ratio | median | range over 9 rounds | target |
    ...
    <!-- end render: split-backward -->

or inside a sentence for a figure: `measured: <!-- render: split-backward-pair (from
docs/results/split_backward_cpu.json; do not edit by hand) -->(BI + BW) / B = 1.044 and BI / B = 0.568 over 9
paired rounds<!-- end render: split-backward-pair --> (...)` in docs/schedules.md.
The text between the markers is exactly what the renderer returns (for a block, with a newline after the
opening marker and before the closing one), so `--check` is a string comparison: a page whose table was
edited by hand, or whose JSON was re-measured without `--write`, fails by name. The marker's JSON must be
the one the registry names (a page always says where its number comes from), every renderer must be used
by some page, and a marker with no renderer fails too.

Adding a table: write one function in dev/doc_renderers.py (or in one of the doc_renderers_*.py modules
it imports, one per page family: BPipe estimates, reproduction at a glance, benchmark prose) that takes the
parsed JSON and returns the markdown, add one line to its RENDERERS (name -> (JSON path under docs/results/, function); a table drawn
from several files names a tuple of paths, its function takes one parsed JSON per path, and its marker lists
them joined by ', '), put the two markers in the page around the
old table, and run `--write`; `git diff` then shows whether the old table said what its JSON says. For
example, `split_backward_table(data)` turns `{"split_over_whole": 1.0435, "round_range": {...}, ...}`
into the three-row table above, with 1.044 in its first cell. Renderers format (round, convert units, at most
take the ratio of two recorded numbers); they never compute results: what a number means is the
benchmark's business, and its JSON holds it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from doc_renderers import RENDERERS  # noqa: E402

PAGES = ("README.md", "docs")
"""README.md and every .md file under docs/ (not docs/papers/, which are the papers' own text)."""

MARKER = re.compile(
    r"<!-- render: (?P<name>[a-z0-9][a-z0-9_.-]*) \(from (?P<source>docs/results/[^;]+); do not edit by hand\) -->"
    r"(?P<body>.*?)<!-- end render: (?P=name) -->", re.DOTALL)
OPENING = re.compile(r"<!-- render: [a-z0-9]")


# ---- the mechanism ---------------------------------------------------------------------------------------

def page_paths(root: str = ROOT) -> list[str]:
    """README.md and docs/**/*.md, relative to root, sorted; docs/papers/ is left out."""
    paths = ["README.md"] if os.path.exists(os.path.join(root, "README.md")) else []
    for folder, subfolders, files in os.walk(os.path.join(root, "docs")):
        subfolders[:] = sorted(d for d in subfolders if os.path.relpath(os.path.join(folder, d), root)
                               != os.path.join("docs", "papers"))
        paths += sorted(os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".md"))
    return paths


def render(name: str, root: str = ROOT) -> str:
    """What renderer `name` writes between its markers, from its JSON under root."""
    source, renderer = RENDERERS[name]
    loaded = []
    for path in source_list(source):
        with open(os.path.join(root, path)) as f:  # a .jsonl (a metrics file) reads as its list of rows
            loaded.append([json.loads(line) for line in f if line.strip()] if path.endswith(".jsonl")
                          else json.load(f))
    return renderer(*loaded)


def source_list(source: str | tuple) -> tuple:
    """A renderer's JSON: one path, or a tuple of paths for a table that spans several files (its function
    then takes one parsed JSON per path, in order; the marker lists them joined by ', ')."""
    return (source,) if isinstance(source, str) else tuple(source)


def render_page(text: str, page: str, root: str = ROOT, used: set | None = None
                ) -> tuple[str, list[str], list[str]]:
    """The page with every marked figure re-rendered; one line per figure that differed from its JSON; one
    line per marker that could not be rendered at all. Each line names the page, the line and the renderer."""
    problems: list[str] = []
    differences: list[str] = []
    cache: dict[str, str] = {}

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    def replace(match: re.Match) -> str:
        name, source, body = match["name"], match["source"], match["body"]
        where = f"{page}:{line_of(match.start())}: render {name}"
        if used is not None:
            used.add(name)
        if name not in RENDERERS:
            problems.append(f"{where}: no such renderer in dev/doc_renderers.py (known: {len(RENDERERS)})")
            return match[0]
        expected = ", ".join(source_list(RENDERERS[name][0]))
        if source != expected:
            problems.append(f"{where}: the marker names {source}, the renderer reads {expected}")
            return match[0]
        try:
            if name not in cache:
                cache[name] = render(name, root)
        except (OSError, ImportError, KeyError, TypeError, ValueError, IndexError) as exc:
            problems.append(f"{where}: cannot render from {source}: {type(exc).__name__}: {exc}")
            return match[0]
        block = body.startswith("\n")
        want = f"\n{cache[name]}\n" if block else cache[name]
        if body != want:
            first = next((i for i, (a, b) in enumerate(zip(body.splitlines(), want.splitlines())) if a != b), None)
            detail = (f"page line {line_of(match.start()) + first}: {body.splitlines()[first].strip()!r}, "
                      f"JSON gives {want.splitlines()[first].strip()!r}" if first is not None
                      else "lines added or missing")
            differences.append(f"{where}: the page disagrees with {source} ({detail})")
        return match[0].replace(f"-->{body}<!--", f"-->{want}<!--", 1)

    new_text = MARKER.sub(replace, text)
    opened, matched = len(OPENING.findall(text)), len(MARKER.findall(text))
    if opened != matched:
        problems.append(f"{page}: {opened - matched} render marker(s) without a matching end marker, or with a "
                        f"malformed '(from docs/results/X.json; do not edit by hand)'")
    return new_text, differences, problems


def run(root: str = ROOT, write: bool = False) -> list[str]:
    """Check (or with `write`, rewrite) every page under root; the problems found (with `write`, only those
    it could not fix), empty when every page agrees with its JSON."""
    problems: list[str] = []
    used: set[str] = set()
    for page in page_paths(root):
        path = os.path.join(root, page)
        with open(path) as f:
            text = f.read()
        new_text, differences, found = render_page(text, page, root, used)
        problems += found if write else differences + found
        if write and new_text != text:
            with open(path + ".tmp", "w") as f:
                f.write(new_text)
            os.replace(path + ".tmp", path)
    problems += [f"dev/doc_renderers.py: renderer {name} ({', '.join(source_list(source))}) is used by no page"
                 for name, (source, _) in RENDERERS.items() if name not in used]
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 naming every figure that disagrees with its JSON")
    mode.add_argument("--write", action="store_true", help="rewrite every marked figure from its JSON")
    parser.add_argument("--root", default=ROOT, help="the repository to read (default: this one)")
    args = parser.parse_args(argv)
    problems = run(args.root, write=args.write)
    for line in problems:
        print(line, file=sys.stderr)
    if args.write:
        print(f"render_docs.py: {len(RENDERERS)} renderers written"
              + (f"; {len(problems)} problem(s) left" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
