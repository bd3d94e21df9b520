"""Figures docs/schedules.md's prose quotes from the simulated schedules of `tools/plot_schedule.py
--compare ... --json FILE` (a list of simulated schedules, or one), so the prose and the tables beside it
read the same JSON (dev/doc_renderers.py registers them).
"""
from __future__ import annotations

from doc_format import num, pct, table


def _named(data, name: str) -> dict:
    runs = data if isinstance(data, list) else [data]
    found = [run for run in runs if run["schedule"] == name]
    if len(found) != 1:
        raise ValueError(f"{name}: {len(found)} simulated runs of that name in the JSON")
    return found[0]


def bubble_of(name: str):
    """A renderer: the simulated bubble of schedule `name` ('27.3%')."""
    return lambda data: pct(_named(data, name)["bubble_fraction"])


def rank0_peak_of(name: str):
    """A renderer: rank 0's simulated peak stash count of `name` ('11')."""
    return lambda data: str(_named(data, name)["peak_stash"][0])


def peaks_against(name: str, other: str):
    """A renderer: rank 0's peak of `name` against `other`'s ('10 against 19')."""
    return lambda data: f"{_named(data, name)['peak_stash'][0]} against {_named(data, other)['peak_stash'][0]}"


def makespans_against(name: str, other: str):
    """A renderer: the makespan of `name` against `other`'s ('102 against 105')."""
    return lambda data: f"{num(_named(data, name)['makespan'], 0)} against {num(_named(data, other)['makespan'], 0)}"


def _idle(run: dict) -> float:
    """Each rank's idle time in the step, when every rank is equally busy (the V schedules' and 1F1B's lists
    at equal costs); refused otherwise, since one figure would then hide the spread."""
    idle = {run["makespan"] - busy for busy in run["busy"]}
    if len(idle) != 1:
        raise ValueError(f"{run['schedule']}: ranks idle for different times {sorted(idle)}")
    return idle.pop()


def v_half_idle(small: list, large: list, f1b_small: dict, f1b_large: dict) -> str:
    """v-half's idle time per rank at the two sizes against 1F1B's on the same model (stages of two chunks),
    and their ratios: '7 time units at p = 4 and 21 at p = 8, against 1F1B's 18 and 42 (0.39 and 0.50 of it'."""
    ours = [_idle(_named(small, "v-half")), _idle(_named(large, "v-half"))]
    theirs = [_idle(f1b_small), _idle(f1b_large)]
    sizes = [f1b_small["num_ranks"], f1b_large["num_ranks"]]
    return (f"{num(ours[0], 0)} time units at p = {sizes[0]} and {num(ours[1], 0)} at p = {sizes[1]}, against "
            f"1F1B's {num(theirs[0], 0)} and {num(theirs[1], 0)} ({num(ours[0] / theirs[0])} and "
            f"{num(ours[1] / theirs[1])} of it")


def two_bw_table(*runs: dict) -> str:
    """docs/2bw.md: per (p, m) the formulas the 2BW tests check against the simulator (1F1B's step
    (m + p − 1)·3, 2BW's steady step m·3 at F = 1, B = 2) and the simulated makespan of `steps` unrolled 2BW
    steps (warm-up and cool-down included) divided by `steps`."""
    rows = []
    for run in runs:
        p, m, steps = run["num_ranks"], run["options"]["microbatches_per_step"], run["options"]["steps"]
        flushed, steady = (m + p - 1) * 3, m * 3
        rows.append([str(p), str(m), str(flushed), str(steady), num(flushed / steady),
                     num(run["makespan"] / steps, 1)])
    return table(["p", "m", "1F1B step (m+p−1)·3", "2BW steady step m·3", "ratio",
                  f"2BW, {runs[0]['options']['steps']} steps incl. warm-up and cool-down, per step"], rows)
