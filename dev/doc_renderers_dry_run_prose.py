"""Figures docs/dry_run.md's prose quotes from the dry runs' JSON (`tools/dry_run_table.py`), beside the
tables that show the same rows (dev/doc_renderers.py registers them). A rank's planner figure is the one
recorded with its run (`planner.memory_bytes` per pipeline rank); "low" is 1 − planner / dry run.
"""
from __future__ import annotations

from doc_renderers_dry_run import GIB, ranks_of


def _ranks(data: dict, name: str | None = None) -> list[tuple[dict, dict]]:
    found = [(res, r) for res, r, _ in ranks_of(data) if name is None or res["name"] == name]
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


TARGET_S = 180  # issue 33's target for every distinct rank of the LLaMA-3-70B 1F1B m 64 job on 2 cores


def against_target(data: dict) -> str:
    """'456 s against the 180 s target, 2.5×': the first configuration's wall clock."""
    wall = data["results"][0]["wall_seconds"]
    return f"{wall:.0f} s against the {TARGET_S} s target, {wall / TARGET_S:.1f}×"


def two_idle_cores(data: dict) -> str:
    """The CPU time spread perfectly over two idle cores: '194 s'."""
    return f"{data['results'][0]['cpu_seconds'] / 2:.0f} s"


def profile_shares(data: dict) -> str:
    """benchmarks/dry_run_profile.py: the executor's time by part, as cProfile shares."""
    shares = data["executor_shares"]

    def share(key: str) -> str:
        value = shares[key] * 100
        return f"{value:.1f}%" if value < 1 else f"{value:.0f}%"
    return (f"FakeTensorMode's own dispatch {share('fake tensor dispatch')} (the cache key built from every "
            f"argument's metadata, and the fake output rebuilt from the cache entry), our tracker "
            f"{share('memory tracker itself')}, the watch {share('communication watch itself')}, model code and "
            f"autograd {share('model code and autograd engine')}")


def meta_stash_ratio(data: dict) -> str:
    """The meta device's stash peak against the CPU device's: 'equal to the byte', or how many times it: '4.2×'."""
    meta, cpu = data["bytes"]["meta"]["stash_peak_bytes"], data["bytes"]["cpu"]["stash_peak_bytes"]
    return "equal to the byte" if meta == cpu else f"{meta / cpu:.1f}×"


def cores_used(data: dict) -> str:
    """CPU seconds over wall seconds of the first configuration: how much of the host the workers got."""
    res = data["results"][0]
    return f"{res['cpu_seconds'] / res['wall_seconds']:.2f} of a core"


def per_rank_seconds(data: dict) -> str:
    """Each rank's CPU seconds and its two steps': 'rank 0 61.1 (30.8 + 28.6), ...'."""
    res = data["results"][0]
    return ", ".join(f"rank {r['rank']} {r['seconds']:.1f} ({' + '.join(f'{s:.1f}' for s in r['step_seconds'])})"
                     for r in res["ranks"])


def speed_pairs(data: dict) -> str:
    """benchmarks/dry_run_profile.py --against: per rank the paired CPU seconds, baseline -> current."""
    parts = []
    for rank, r in data["ranks"].items():
        pairs = ", ".join(f"{b:.1f} -> {c:.1f}" for b, c in zip(r["baseline_seconds"], r["current_seconds"]))
        same = "every byte field and all {} recorded calls identical".format(r["calls"]) if (
            r["bytes_equal"] and r["calls_equal"]) else "FIGURES DIFFER"
        parts.append(f"rank {rank}: {pairs} CPU s (median ratio {r['median_current_over_baseline']:.2f}; {same})")
    return (f"{'; '.join(parts)}; load average {data['load_average_before'][0]:.1f} before, "
            f"{data['load_average_after'][0]:.1f} after, {data['baseline_rev'][:7]} against {data['current_rev'][:7]}")


def profile_parts(data: dict) -> str:
    """The executor's time by part, with the fake dispatch split into key, output, kernels and the rest."""
    shares, inside = data["executor_shares"], data["fake_dispatch_shares"]
    pct = lambda value: f"{value * 100:.1f}%" if value < 0.01 else f"{value * 100:.0f}%"  # noqa: E731
    return (f"FakeTensorMode's dispatch {pct(shares['fake tensor dispatch'])} (the cache key "
            f"{pct(inside['cache key'])}, a cache hit's output {pct(inside['cache hit output'])}, the fake kernels "
            f"of misses and of the operators torch never caches {pct(inside['fake kernels (misses, uncached operators)'])}, "
            f"the lookup and the rest {pct(inside['cache lookup and the rest'])}), our tracker "
            f"{pct(shares['memory tracker itself'])}, the watch {pct(shares['communication watch itself'])}, model "
            f"code and autograd {pct(shares['model code and autograd engine'])}")
