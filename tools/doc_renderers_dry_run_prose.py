"""Figures docs/dry_run.md's prose quotes from the dry runs' JSON (`tools/dry_run_table.py`), beside the
tables that show the same rows (tools/doc_renderers.py registers them). A rank's planner figure is the one
recorded with its run (`planner.memory_bytes` per pipeline rank); "low" is 1 − planner / dry run.
"""
from __future__ import annotations

GIB = 2**30


def _ranks(data: dict, name: str | None = None) -> list[tuple[dict, dict]]:
    found = [(res, r) for res in data["results"] if name is None or res["name"] == name for r in res["ranks"]]
    if not found:
        raise ValueError(f"no dry-run rows named {name!r}")
    return found


def _low(res: dict, r: dict) -> float:
    return 1 - res["planner"]["memory_bytes"][r["pipeline_rank"]] / r["peak_bytes"]


def _backward(pairs):
    return [(res, r) for res, r in pairs if "optimizer" not in r["peak_at"]]


def _optimizer(pairs):
    return [(res, r) for res, r in pairs if "optimizer" in r["peak_at"]]


def _span(values: list[float], fmt) -> str:
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low} to {high}"


def backward_low(data: dict) -> str:
    """'1.0% to 1.4% low on ranks 0 to 5': the planner against the ranks that peak in a backward."""
    pairs = _backward(_ranks(data))
    pp = [r["pipeline_rank"] for _, r in pairs]
    return (f"{_span([_low(res, r) for res, r in pairs], lambda v: f'{v * 100:.1f}%')} low on ranks "
            f"{min(pp)} to {max(pp)}")


def backward_transient(data: dict) -> str:
    """The measured transient of the ranks that peak in a backward: '0.32 GiB'."""
    return _span([r["transient_peak_bytes"] / GIB for _, r in _backward(_ranks(data))], lambda v: f"{v:.2f}") + " GiB"


def _pairs_text(values: list[str]) -> str:
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + f" and {values[-1]}"


def optimizer_ranks(data: dict) -> str:
    """'6 and 7': the pipeline ranks that peak in the optimizer step."""
    return _pairs_text([str(r["pipeline_rank"]) for _, r in _optimizer(_ranks(data))])


def optimizer_transient(data: dict) -> str:
    """'3.99 and 4.48 GiB': their transients (the optimizer's temporaries)."""
    return _pairs_text([f"{r['transient_peak_bytes'] / GIB:.2f}" for _, r in _optimizer(_ranks(data))]) + " GiB"


def optimizer_low(data: dict) -> str:
    """'2.9% and 10.3% low'."""
    return _pairs_text([f"{_low(res, r) * 100:.1f}%" for res, r in _optimizer(_ranks(data))]) + " low"


def fused_against_foreach(fused: dict, foreach: dict) -> str:
    """The peaks of the ranks that peaked in the optimizer step under foreach AdamW, with the fused kernel
    and with foreach: '21.60 and 22.47 GiB, against 21.92 and 24.63 with foreach'."""
    ranks = [r["pipeline_rank"] for _, r in _optimizer(_ranks(foreach))]
    by_rank = {r["pipeline_rank"]: r for _, r in _ranks(fused, "llama3-70b-1f1b")}
    before = {r["pipeline_rank"]: r for _, r in _ranks(foreach)}
    now = _pairs_text([f"{by_rank[p]['peak_bytes'] / GIB:.2f}" for p in ranks])
    then = _pairs_text([f"{before[p]['peak_bytes'] / GIB:.2f}" for p in ranks])
    return f"{now} GiB, against {then} with foreach"
