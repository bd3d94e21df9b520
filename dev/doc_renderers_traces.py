"""The figures docs/schedules.md's prose quotes from the traced real runs of `tools/trace_vs_sim.py` (the
section "The simulator against real runs"), read from the runs' JSON (dev/doc_renderers.py registers them).

Each renderer takes one or more reports (`{"runs": [...], "target_relative_error": ...}`) and returns the
phrase that stands in the page; nothing is computed beyond minima, maxima and counts over the recorded runs.
"""
from __future__ import annotations

from doc_format import num


def _runs(reports: tuple[dict, ...]) -> list[dict]:
    return [run for report in reports for run in report["runs"]]


def _span(values: list[float], places: int = 0, unit: str = "") -> str:
    low, high = num(min(values), places), num(max(values), places)
    return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"


def _within(run: dict, target: float) -> bool:
    return run["relative_error"] <= target


def within_target(report: dict) -> str:
    """Which (schedule, p) of one run are within the target: 'all four schedules at p = 4 and none at p = 2'."""
    target = report["target_relative_error"]
    parts = []
    for pp in sorted({run["pp"] for run in report["runs"]}):
        runs = [run for run in report["runs"] if run["pp"] == pp]
        inside = [run["schedule"] for run in runs if _within(run, target)]
        if len(inside) == len(runs):
            what = f"all {len(runs)} schedules"
        elif not inside:
            what = "none"
        else:
            what = ", ".join(f"`{name}`" for name in inside)
        parts.append(f"{what} at p = {pp}")
    return " and ".join(parts)


def within_at(pp: int):
    """A renderer: the schedules of one run at pipeline size `pp` that are within the target, "`1f1b`", or
    'none'."""
    def render(report: dict) -> str:
        target = report["target_relative_error"]
        inside = [f"`{run['schedule']}`" for run in report["runs"] if run["pp"] == pp and _within(run, target)]
        return ", ".join(inside) if inside else "none"
    return render


def bubble_spread(*reports: dict) -> str:
    """How far one run's per-step bubbles spread, largest over smallest step, lowest to highest over the
    rows: '1.2 to 9'."""
    ratios = [max(run["trace_bubble_per_step"]) / min(run["trace_bubble_per_step"]) for run in _runs(reports)]
    low, high = min(ratios), max(ratios)
    return f"{num(low, 1)} to {num(high, 0) if high >= 5 else num(high, 1)}"


def trace_above(*reports: dict) -> str:
    """In how many rows the trace's bubble is above the simulated one: '14 of the 16 rows'."""
    runs = _runs(reports)
    above = sum(run["trace_bubble"] > run["sim_bubble"] for run in runs)
    return f"{above} of the {len(runs)} rows"


def blocked_delay(*reports: dict) -> str:
    """Range of the per-row medians of the delay from a send's post to the end of its blocked consumer's
    wait: '2–106 ms'."""
    medians = [run["blocked_receive_delay_ms"]["median"] for run in _runs(reports)]
    low = min(medians)
    return f"{num(low, 1 if low < 1 else 0)}–{num(max(medians), 0)} ms"


def link_round_trip(*reports: dict) -> str:
    """The link's round trip (twice the recorded one-way latency, half the shortest clock-sync round trip),
    lowest to highest: '0.2–8 ms'."""
    trips = [2 * run["p2p_latency_ms"] for run in _runs(reports)]
    return f"{num(min(trips), 1)}–{num(max(trips), 0)} ms"


def executor_share(*reports: dict) -> str:
    """The executor's own work as a share of a rank's busy time, lowest to highest over ranks and rows."""
    shares = [share * 100 for run in _runs(reports) for share in run["executor_share_of_busy"]]
    return _span(shares, unit="%")


def errors_at(pp: int):
    """A renderer: the range of relative errors of one report's rows at pipeline size `pp`: '3–13%'."""
    def render(report: dict) -> str:
        return _span([run["relative_error"] * 100 for run in report["runs"] if run["pp"] == pp], unit="%")
    return render


def outside_target_at(pp: int):
    """A renderer: how many rows at `pp` are within the target and each one outside with its error:
    'three of four (`zb-v` at 15.1%)'."""
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}

    def render(report: dict) -> str:
        target = report["target_relative_error"]
        runs = [run for run in report["runs"] if run["pp"] == pp]
        outside = [run for run in runs if not _within(run, target)]
        inside = len(runs) - len(outside)
        count = f"{words.get(inside, inside)} of {words.get(len(runs), len(runs))}"
        if not outside:
            return f"{count}"
        errors = ", ".join(f"`{run['schedule']}` at {run['relative_error'] * 100:.1f}%" for run in outside)
        return f"{count} ({errors})"
    return render


def above_outside_first(pp: int):
    """A renderer over several reports: rows at `pp` other than 1f1b's with the trace above the simulation,
    'all six' when every one is."""
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}

    def render(*reports: dict) -> str:
        runs = [run for run in _runs(reports) if run["pp"] == pp and run["schedule"] != "1f1b"]
        above = sum(run["trace_bubble"] > run["sim_bubble"] for run in runs)
        total = words.get(len(runs), str(len(runs)))
        return f"all {total}" if above == len(runs) else f"{above} of {total}"
    return render
