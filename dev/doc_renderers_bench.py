"""Figures that docs/benchmarks.md, docs/layered.md and docs/gpu.md quote in their prose from a benchmark's JSON (dev/doc_renderers.py
registers them; the helpers there format). Each takes the parsed JSON and returns the words between the
markers; a ratio is at most the ratio of two recorded numbers.
"""
from __future__ import annotations

from doc_format import num, pct


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


def _traffic_mib(entry: dict) -> float:
    totals = entry["totals"]
    return sum(v[1] for v in totals.values()) / 2**20


def layered_traffic_sentence(data: dict) -> str:
    """benchmarks/bench_layered.py traffic: rank 0's total data-parallel MiB per step of layered (one group)
    and of depth-first ZeRO-3 per m, as in its table: 'Layered with one group: 2.57 MiB per step at every m.
    Depth-first ZeRO-3: 2.57, 6.24, 12.52, 25.07 MiB for m = 2, 4, 8, 16'."""
    rows = data["rows"]
    layered = {m: num(_traffic_mib(e)) for m, e in rows["layered ZeRO-3 (looped-bfs, B = m)"].items()}
    depth = rows["depth-first ZeRO-3 (interleaved 1F1B)"]
    each = (f"{next(iter(layered.values()))} MiB per step at every m" if len(set(layered.values())) == 1
            else ", ".join(f"{v} MiB at m = {m}" for m, v in layered.items()))
    return (f"Layered with one group: {each}. Depth-first ZeRO-3: "
            f"{', '.join(num(_traffic_mib(e)) for e in depth.values())} MiB for m = {', '.join(depth)}")


def layered_weights_sentence(data: dict) -> str:
    """The most weights the ZeRO-3 variants hold gathered at once on rank 0, as in the table: '0.54 MiB of the
    rank's 0.92 MiB of weights'."""
    entries = [e for setup, by_m in data["rows"].items() if "ZeRO-3" in setup for e in by_m.values()]
    peak = max(entries, key=lambda e: e["peak_weight_bytes"] / e["model_bytes"])
    return (f"{num(peak['peak_weight_bytes'] / 2**20)} MiB of the rank's {num(peak['model_bytes'] / 2**20)} MiB "
            f"of weights")


def acceptor_pairs_sentence(data: dict) -> str:
    """The paired BPipe acceptor runs (benchmarks/bench_schedules.py on two trees): the median change of the
    bpipe / 1F1B step ratio with its range, and the stash peaks of the acceptor before and after and of
    rank 0 (MB = 10^6 bytes; the peaks are the same in every pair)."""
    lo, hi = data["bpipe_over_1f1b_after_over_before_min_max"]
    first = data["pairs"][0]
    before, after = first["before_bpipe_peak_stash_bytes_per_rank"], first["after_bpipe_peak_stash_bytes_per_rank"]
    return (f"a median factor of {num(data['bpipe_over_1f1b_after_over_before_median'])} ({num(lo)}–{num(hi)} over "
            f"the pairs); rank {len(after) - 1}, the acceptor, peaked at {num(after[-1] / 1e6)} MB of stashes "
            f"against the thread's {num(before[-1] / 1e6)} MB, rank 0 at {num(after[0] / 1e6)} MB")


def vs_torch_identical(data: dict) -> str:
    """The bench_vs_torch.py pairs whose check step gave the same gradients to the bit (largest relative
    difference 0.0): '`1f1b` and `interleaved-1f1b`'."""
    same = [f"`{name}`" for name, pair in data["pairs"].items() if pair["check"]["grad_rel_diff_max"] == 0.0]
    return " and ".join([", ".join(same[:-1]), same[-1]] if len(same) > 1 else same) or "none"


def _profile_own(ranks: list, needle: str, field: str = "own_s_per_step") -> list[float]:
    """Per rank, the named function's seconds per step in a bench_vs_torch.py profile (0 where not listed)."""
    return [sum(f[field] for f in rank if needle in f["function"]) for rank in ranks]


def vs_torch_profile_sentence(data: dict) -> str:
    """The 1f1b profile of docs/results/vs_torch_cpu.json (cProfile per rank, seconds per step): ours' range over
    the ranks for autograd's backward, the linear GEMMs, attention and GeLU, the largest relative difference
    from torch's same rank, and the activation store's saved-tensor hook (cumulative, ours only)."""
    prof = data["profiles"]["1f1b"]
    parts, worst = [], 0.0
    for needle, what in (("run_backward", "autograd's backward"), ("_nn.linear", "the linear GEMMs"),
                         ("scaled_dot_product_attention", "attention"), ("_nn.gelu", "GeLU")):
        ours, theirs = _profile_own(prof["ours"], needle), _profile_own(prof["torch"], needle)
        worst = max([worst] + [abs(a / b - 1) for a, b in zip(ours, theirs) if b])
        lo, hi = f"{min(ours):.2f}", f"{max(ours):.2f}"
        parts.append(f"{lo if lo == hi else lo + '–' + hi} s in {what}")
    hook = _profile_own(prof["ours"], "schedules/store.py:82", "cumulative_s_per_step")
    return (f"{', '.join(parts)} per step and rank, the same on both sides within {pct(worst, 0)}; the one visible "
            f"cost ours has that torch has not is the activation store's saved-tensor hook "
            f"({min(hook):.3f}–{max(hook):.3f} s per step per rank cumulative)")
