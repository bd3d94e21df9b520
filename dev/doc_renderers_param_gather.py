"""Figures docs/dry_run.md quotes on --overlap-param-gather: a full-size dry run with the overlap beside the same
configuration without it (`tools/dry_run_table.py`, the same pipeline ranks in both)."""
from __future__ import annotations

from doc_renderers_dry_run import ranks_of

MIB = 2**20


def _bytes(delta: int) -> str:
    """'+8 MiB + 8 B' (exact below 1 KiB over whole MiB), '+472.6 MiB', '+56 B', 'unchanged'."""
    if delta == 0:
        return "unchanged"
    sign = "+" if delta > 0 else "−"
    whole, rest = divmod(abs(delta), MIB)
    if whole == 0:
        return f"{sign}{rest} B"
    if rest >= 1024:
        return f"{sign}{abs(delta) / MIB:.1f} MiB"
    return f"{sign}{whole} MiB" + (f" + {rest} B" if rest else "")


def overlap_peak_change(plain: dict, overlapped: dict) -> str:
    """Per pipeline rank measured in both runs: how much the overlap moved its total peak and where the peak
    fell, e.g. 'pipeline rank 0 unchanged (step 2, B0.0); pipeline rank 7 +8 MiB + 8 B (step 1, optimizer)'."""
    before = {r["pipeline_rank"]: r for _, r, _ in ranks_of(plain)}
    parts = []
    for _, r, _ in ranks_of(overlapped):
        base = before.get(r["pipeline_rank"])
        if base is None:
            raise ValueError(f"pipeline rank {r['pipeline_rank']} was not measured without the overlap")
        parts.append(f"pipeline rank {r['pipeline_rank']} {_bytes(r['peak_bytes'] - base['peak_bytes'])} "
                     f"({r['peak_at']})")
    return "; ".join(parts)


def planner_against_overlap(overlapped: dict) -> str:
    """The planner as recorded with the run against the dry run, per pipeline rank: 'pipeline rank 0 1.000,
    pipeline rank 7 0.979 (planner 21.62 GiB, dry run 22.07 GiB, peak at step 2, F7.0)'."""
    parts = []
    for res, r, _ in ranks_of(overlapped):
        planned = res["planner"]["memory_bytes"][r["pipeline_rank"]]
        parts.append(f"pipeline rank {r['pipeline_rank']} {planned / r['peak_bytes']:.3f} (planner "
                     f"{planned / 2**30:.2f} GiB, dry run {r['peak_bytes'] / 2**30:.2f} GiB, peak at {r['peak_at']})")
    return "; ".join(parts)
