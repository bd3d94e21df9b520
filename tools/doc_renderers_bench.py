"""Figures that docs/benchmarks.md quotes in its prose from a benchmark's JSON (tools/doc_renderers.py
registers them; the helpers there format). Each takes the parsed JSON and returns the words between the
markers; a ratio is at most the ratio of two recorded numbers.
"""
from __future__ import annotations

from doc_renderers import num


def build_growth_sentence(data: dict) -> str:
    """benchmarks/bench_schedule_build.py: what each doubling of m costs in CPU time, with the JSON's own
    `growth_vs_linear`: '1.85× and 1.86× the CPU time (`growth_vs_linear` 0.92 and 0.93 in the JSON)'."""
    rows = data["rows"]
    steps = [num(b["total_cpu_s"] / a["total_cpu_s"]) + "×" for a, b in zip(rows, rows[1:])]
    growth = [num(r["growth_vs_linear"]) for r in rows[1:]]
    return f"{' and '.join(steps)} the CPU time (`growth_vs_linear` {' and '.join(growth)} in the JSON)"


def build_actions(data: dict) -> str:
    """The largest schedule's action count and m: '782,336 actions at m = 1024'."""
    last = data["rows"][-1]
    return f"{num(last['actions'], 0)} actions at m = {last['microbatches']}"


def plot_size_sentence(data: dict) -> str:
    """dev/bench_plot_schedule.py: the drawn schedule's size: '195,584 actions, a 253 KB PNG'."""
    return f"{num(data['actions'], 0)} actions, a {num(data['png_bytes'] / 1000, 0)} KB PNG"


def plot_wall_sentence(data: dict) -> str:
    """The median round's wall seconds for build, simulate and draw, and the import's CPU seconds: '10.1 s
    of wall time beside the CI run; importing torch and matplotlib adds 2.9 s'."""
    return (f"{num(data['median_cpu_s']['total_wall_s'], 1)} s of wall time beside the CI run; importing torch "
            f"and matplotlib adds {num(data['import_s']['cpu_s'], 1)} s")


def mfu_spread(data: dict) -> str:
    """benchmarks/bench_mfu.py: the per-round spread of ours / HF tokens/s: '0.75×–1.22×'."""
    r = data["ratio_tokens_per_s"]
    return f"{num(r['min'])}×–{num(r['max'])}×"


def vs_torch_cpu_sentence(*names: str):
    """A renderer of the CPU ratios (ours / torch, median) of the named bench_vs_torch.py pairs: '`zb-h1`
    0.958, `zb-v` 0.883'."""
    def render(data: dict) -> str:
        return ", ".join(f"`{n}` {num(data['pairs'][n]['cpu_ratio_ours_over_torch']['median'], 3)}" for n in names)
    render.__doc__ = f"The CPU ratios of {', '.join(names)} in docs/results/vs_torch_cpu.json."
    return render
