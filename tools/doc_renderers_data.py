"""The figures docs/data.md and README.md quote about the demo corpus, read from docs/results/demo_corpus.json
(written by `python -m megatron_pp.data.demo_corpus runs/demo-data --stats-json docs/results/demo_corpus.json`,
the demo's data step; tools/doc_renderers.py registers them). Each takes the parsed JSON and returns the phrase
that stands between the page's markers; nothing is computed but unit changes.
"""
from __future__ import annotations

from doc_format import num, pct


def _megabytes(n_bytes: int) -> str:
    """Decimal megabytes, as a file listing shows them: 2563563 -> '2.56 MB'."""
    return f"{n_bytes / 1e6:.2f} MB"


def demo_corpus_megabytes(data: dict) -> str:
    """README's size of the corpus: '2.56 MB'."""
    return _megabytes(data["corpus_bytes"])


def demo_corpus_size(data: dict) -> str:
    """'655 documents, 2.56 MB of JSON lines (Python 3.11.7's standard library)'."""
    return (f"{num(data['documents'], 0)} documents, {_megabytes(data['corpus_bytes'])} of JSON lines "
            f"(Python {data['python']}'s standard library)")


def demo_corpus_tokens(data: dict) -> str:
    """The token count, whole and per split of the demo's --split: '706,697 tokens, EOD included; the demo's
    `--split 95,5,0` trains on 674,167 of them in 622 documents and validates on 32,530 in 33'."""
    splits = data["splits"]
    used = [(name, splits[name]) for name in ("train", "valid", "test") if splits[name]]
    verbs = {"train": "trains on", "valid": "validates on", "test": "tests on"}
    parts = [f"{verbs[name]} {num(s['tokens'], 0)} " + ("of them " if i == 0 else "") +
             f"in {num(s['documents'], 0)}" + (" documents" if i == 0 else "") for i, (name, s) in enumerate(used)]
    return (f"{num(data['tokens'], 0)} tokens, EOD included; the demo's `--split {data['split']}` "
            + " and ".join(parts))


# Host load averages that timing JSONs record, rendered where a page names the machine a run was timed on
# (docs/benchmarks.md); a load average no JSON holds is marked in the page as read off the host.

def load_at_start(data: dict) -> str:
    """One reading, taken when the run started: 'load average 14.4 at the start'."""
    return f"load average {num(data['load_average_at_start'], 1)} at the start"


def load_start_to_end(data: dict) -> str:
    """Readings at the start and the end of the run: 'load average 2.4 at the start, 2.6 at the end'."""
    return (f"load average {num(data['load_average_start'], 1)} at the start, "
            f"{num(data['load_average_end'], 1)} at the end")


# docs/planner.md, "Against the dry run": the prose figures of tools/validate_planner.py's full-size comparison
# (docs/results/planner_vs_dry_run_full_size.json; the table above them renders the same rows).

def _rank_row(data: dict, preset: str, configuration_start: str, last: bool) -> dict:
    """The first or last pipeline rank's row of the one result whose preset and configuration match."""
    results = [r for r in data["results"] if r["preset"] == preset and r["configuration"].startswith(configuration_start)]
    if len(results) != 1:
        raise ValueError(f"{len(results)} results for {preset} {configuration_start!r}, expected one")
    ranks = sorted(results[0]["ranks"], key=lambda r: r["pipeline_rank"])
    return ranks[-1] if last else ranks[0]


def planner_backward_working_set(data: dict) -> str:
    """The planner's backward working set on LLaMA-3-70B 1F1B, first and last stage: ('0.32 GiB', '0.39 GiB')
    joined as the sentence has them."""
    first, last = (_rank_row(data, "llama3-70b", "1f1b tp8 pp8 dp1 b=1 recompute=none", end) for end in (False, True))
    return (f"{num(first['predicted_backward_bytes'] / 2**30)} GiB on the first stage, "
            f"{num(last['predicted_backward_bytes'] / 2**30)} GiB on the last")


def planner_high_on_last_rank(data: dict) -> str:
    """How far above the dry run the planner is on the last rank of 1F1B with full recomputation and of
    looped-bfs: '+0.51% and +0.45%'."""
    rows = (_rank_row(data, "llama3-70b", "1f1b tp8 pp8 dp1 b=1 recompute=full", True),
            _rank_row(data, "llama3-70b", "looped-bfs", True))
    return " and ".join(pct(r["predicted_over_measured"] - 1, 2, sign=True) for r in rows)


def planner_po_h_last_rank(data: dict) -> str:
    """PO-H's last rank, planner over dry run less one: '+0.11%'."""
    return pct(_rank_row(data, "llama3-70b", "po-h", True)["predicted_over_measured"] - 1, 2, sign=True)


def plan_best_mfu(data: dict) -> str:
    """docs/planner.md: the MFU of the best-ranked row of the committed plan ('65% in its best row')."""
    return f"{pct(data['ranked'][0]['mfu'], 0)} in its best row"
