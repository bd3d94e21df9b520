"""docs/reproduction.md's "At a glance" table and the figures its prose quotes, from the rows of
`tools/reproduce.py all --check --json docs/results/reproduce_full.json` (dev/doc_renderers.py registers them).

Each paper names a few groups of its rows (a regular expression on the row's claim) and what to show of each
group: the rows' predicted figures one by one (`each`), their range (`span`), or the range of their recorded
errors (`errors`). A figure is read out of a row's predicted text with a regular expression; a range is the
smallest and largest of the recorded numbers. Nothing else is computed. The headline claims are the papers'
(published, not measured); the verdicts stay in the page, beside the table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from doc_format import pct, table


@dataclass(frozen=True)
class Group:
    """Rows of one paper whose claim matches `claim` (searched); `figure` pulls the number shown out of the
    predicted text (its first group); `how` is 'each' (every row's figure, tagged with the claim's `tag`
    group when it has one, and its error when recorded), 'span' (lowest to highest figure, with the range of their errors) or 'errors'
    (lowest to highest recorded error)."""
    label: str
    claim: str
    how: str = "each"
    figure: str = r"^([^:;(]+?)(?: \(|:|;|$)"


def _rows(report: dict, group: Group) -> list[dict]:
    rows = [r for r in report["rows"] if re.search(group.claim, r["claim"])]
    if not rows:
        raise ValueError(f"{report['paper']}: no row's claim matches {group.claim!r}")
    return rows


def _figure(row: dict, group: Group) -> str | None:
    found = re.search(group.figure, row["predicted"])
    return found[1].strip() if found else None


def group_text(report: dict, group: Group) -> str:
    """One group of rows as prose: '0.62× (96B, −51%), a variant does not fit (134B)'."""
    rows = _rows(report, group)
    if group.how == "errors":
        errors = sorted(r["error"] for r in rows if r["error"] is not None)
        return f"{group.label} {pct(errors[0], 0, sign=True)} to {pct(errors[-1], 0, sign=True)}".strip()
    figures = [(r, _figure(r, group)) for r in rows]
    figures = [(r, f) for r, f in figures if f is not None]
    if group.how == "span":
        values = sorted(figures, key=lambda pair: float(re.match(r"[+−-]?[0-9.]+", pair[1])[0].replace("−", "-")))
        low, high = values[0][1], values[-1][1]
        errors = sorted(r["error"] for r, _ in figures if r["error"] is not None)
        error = (f" ({pct(errors[0], 0, sign=True)}" + ("" if len(errors) == 1 else
                                                         f" to {pct(errors[-1], 0, sign=True)}") + ")") if errors else ""
        return f"{group.label} {low}" + ("" if low == high else f" to {high}") + error
    parts = []
    for r, f in figures:
        tag = re.search(group.claim, r["claim"]).groupdict().get("tag")
        notes = [n for n in (tag, None if r["error"] is None else pct(r["error"], 0, sign=True)) if n]
        parts.append(f + (f" ({', '.join(notes)})" if notes else ""))
    return f"{group.label} {', '.join(parts)}".strip()


GLANCE = {
    "bpipe": ("BPipe", "1.25×–2.17× over Megatron-LM, GPT-3 96B/134B", (
        Group("`bpipe` as configured:", r"GPT-3 (?P<tag>\S+): speedup of `bpipe` over"),
        Group("best against best (b ≤ 4, any recompute):",
              r"GPT-3 (?P<tag>\S+): best BPipe configuration over best 1F1B"),
        Group("without selective recompute and with pairs on one node:",
              r"GPT-3 (?P<tag>\S+): same, no selective recompute and pairs on one node"))),
    "bpipe-reeval": ("BPipe re-evaluation", "gain on GPT-3, none with FlashAttention, none on LLaMA", (
        Group("best against best:", r"^(?P<tag>.+): BPipe speedup$", figure=r"best-vs-best ([0-9.]+×)"),
        Group("as configured:", r"^(?P<tag>.+): BPipe speedup$", figure=r"config pair ([0-9.]+×)"))),
    "pipeoffload": ("PipeOffload", "GIS-H halves, PO-H ≈ 1/5 of 1F1B-I memory at similar MFU; PP beats TP8 by "
                    "12–19%", (
        Group("activation ratios to 1F1B-I (GIS-H, GIS, 1F1B):", r" (gis|gis-h|1f1b) activation / 1F1B-I$",
              "errors"),
        Group("absolute activation bytes (1F1B-I, GIS, GIS-H, 1F1B):", r"k (1f1b-i|gis|gis-h|1f1b) activation$",
              "errors"),
        Group("PO-H and PO-F activation:", r"k (po-h|po-f) activation$", "errors"),
        Group("MFU (uncalibrated):", r" MFU$", "errors"),
        Group("k:", r": k, PCIe round trip", "errors"),
        Group("PP over TP8:", r"MFU gain of PO at pp", "span", figure=r"^([+−-]?[0-9.]+%)"))),
    "2bw": ("PipeDream-2BW", "up to 1.6× over Flush, 3.2× over GPipe", (
        Group("over Flush:", r"2BW / PipeDream-Flush throughput", "span", figure=r"^([0-9.]+×)"),
        Group("over GPipe:", r"2BW / GPipe throughput", "span", figure=r"^([0-9.]+×)"))),
    "breadth-first": ("Breadth-first", "up to +43% over Megatron-LM's best configuration, 52B", (
        Group("looped-bfs over ours at the same layout:", r"gain over our (?P<tag>\S+) at the same layout",
              figure=r"^(\+[0-9]+%)"),)),
    "layered": ("Layered GA + modular pipeline (arXiv 2106.02679)", "halves the shortest training time; less data "
                "movement, no fast InfiniBand needed; ZeRO memory a small fraction of the GPU (abstract; no "
                "numbers used)", (
        Group("over 1F1B at m = p:", r"^Shortest training time", figure=r"^([0-9.]+×)"),
        Group("data-parallel bytes per GPU per step, m = 8 / 16 / 32:", r"^Data movement",
              figure=r"^(layered ZeRO-3 [0-9. /]+GB)"),
        Group("slowest link for ≤ 5% exposed data-parallel time, m = 8 / 32:", r"^Network: slowest",
              figure=r"^(layered \+ modular [0-9. /]+GB/s)"),
        Group("memory on rank 0, m = 8:", r"^Memory with ZeRO", figure=r"\(([0-9]+% of the GPU)\)"))),
}
"""Per paper: its name, its headline claim (published) and the groups of reproduce_full.json rows shown."""


def _report(data: dict, paper: str) -> dict:
    (report,) = [r for r in data["reports"] if r["paper"] == paper]
    return report


def glance_table(data: dict) -> str:
    """The "At a glance" table: per paper, its headline claim and the selected predictions (with errors)."""
    rows = []
    for paper, (name, claim, groups) in GLANCE.items():
        report = _report(data, paper)
        rows.append([name, claim, "; ".join(group_text(report, g) for g in groups)])
    return table(["Paper", "Headline claim", "Our prediction (error against the published figure)"], rows)


def glance_figure(paper: str, label: str):
    """A renderer of one group of the table, for a sentence of the page that quotes it."""
    (group,) = [g for g in GLANCE[paper][2] if g.label == label]

    def render(data: dict) -> str:
        return group_text(_report(data, paper), Group("", group.claim, group.how, group.figure)).strip()
    render.__doc__ = f"The '{label}' figures of {paper} in docs/results/reproduce_full.json, without the label."
    return render


def rows_text(paper: str, claim: str, form: str = "{predicted}", sep: str = ", "):
    """A renderer quoting the rows of `paper` whose claim matches `claim` (searched; at least one), each as
    `form` with {predicted}, {published}, {error} (the recorded error as a signed percentage) and {tag}
    (the claim's `tag` group), joined by `sep`: the figures a paragraph of docs/reproduction.md discusses."""
    group = Group("", claim)

    def render(data: dict) -> str:
        rows = _rows(_report(data, paper), group)
        return sep.join(form.format(predicted=r["predicted"], published=r["published"],
                                    error="—" if r["error"] is None else pct(r["error"], 0, sign=True),
                                    tag=re.search(claim, r["claim"]).groupdict().get("tag"))
                        for r in rows)
    render.__doc__ = f"The {paper} rows matching {claim!r} of docs/results/reproduce_full.json, as {form!r}."
    return render


def rows_errors(paper: str, claim: str):
    """A renderer of the range of the recorded errors of `paper`'s rows matching `claim`: '+3% to +14%'."""
    group = Group("", claim, "errors")

    def render(data: dict) -> str:
        return group_text(_report(data, paper), group).strip()
    render.__doc__ = f"The error range of the {paper} rows matching {claim!r} in docs/results/reproduce_full.json."
    return render
