"""The figures docs/data.md and README.md quote about the demo corpus, read from docs/results/demo_corpus.json
(written by `python -m megatron_pp.data.demo_corpus runs/demo-data --stats-json docs/results/demo_corpus.json`,
the demo's data step; tools/doc_renderers.py registers them). Each takes the parsed JSON and returns the phrase
that stands between the page's markers; nothing is computed but unit changes.
"""
from __future__ import annotations

from doc_format import num


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
