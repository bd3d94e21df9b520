"""docs/reliability.md's figure for each round's changes (`dev/mutation_check.py --since COMMIT`): the current
sample beside the one before it, one row each, from the reports the tool wrote (`--out`, annotated with
`--annotate`). Renderers only format: every count is a field of the report, the score is killed / non_equivalent.
"""
from __future__ import annotations

from doc_format import pct, table


def _seed(data: dict) -> str:
    """'seed 46' from the report's recorded command line."""
    return "seed " + data["command"].split("--seed ")[1].split()[0]


def _fate(data: dict) -> str:
    """What became of the non-equivalent survivors since the sample ran, by their notes: killed by a test
    written for them, fixed (a bug found at the spot), or open (understood and not killed, or no note yet)."""
    survivors = [s for s in data["survivors"] if "equivalent" not in s]
    killed = sum("killed_by" in s for s in survivors)
    fixed = sum("fixed" in s and "killed_by" not in s for s in survivors)
    parts = [f"{killed} killed by a test written since"] if killed or not survivors else []
    parts += [f"{fixed} fixed since"] if fixed else []
    parts += [f"{len(survivors) - killed - fixed} open"] if len(survivors) > killed + fixed else []
    return ", ".join(parts)


def _row(data: dict, label: str) -> list[str]:
    ran = f" ({data['partial']} run)" if "partial" in data else ""
    return [f"{_seed(data)}{ran}, {label}", f"`{data['at'][:7]}`", str(data["total"]),
            f"{data['killed']} ({data['timeouts']})", str(data["equivalent"]),
            f"**{data['killed']} / {data['non_equivalent']} = {pct(data['killed'] / data['non_equivalent'])}**",
            _fate(data)]


def since_table(current: dict, previous: dict) -> str:
    """The current `--since` sample and the previous one: seed (and whether the run stopped early), the
    commit it mutated, mutants, killed when it ran (time-outs among them), equivalent survivors, the score,
    and what became of the other survivors since."""
    return table(["sample", "mutated commit", "mutants", "killed when it ran (by time-out)", "equivalent",
                  "score (killed / non-equivalent)", "non-equivalent survivors"],
                 [_row(current, "current"), _row(previous, "previous")])
