"""Layered gradient accumulation and modular pipeline parallelism (Lamy-Poirier, arXiv 2106.02679): the
paper's own claims, each predicted by the simulator on one setting, and the small-scale bubble and
reduction-count trends.

The paper is an analysis of trillion-parameter training on commodity clusters; what it claims (abstract)
is that layered gradient accumulation with the modular (looping) pipeline halves the shortest training
time, cuts data movement so that fast InfiniBand is unnecessary, and makes ZeRO's memory use a small
fraction of the GPU. Its own models, cluster and batch are not used here (no number of its tables is
taken), so every claim is predicted on one stated setting: the 52B model of `breadth_first_52b.yaml`
(64 × 8192, 64 A100-80GB, pp 8 × dp 8, micro-batch 1) with its three variants: `looped-bfs` (one layer per
stage, v = 8, layered accumulation, ZeRO-3), `interleaved-1f1b` (same placement, depth-first, ZeRO-1)
and `1f1b` (contiguous stages, ZeRO-1), both baselines with full recomputation as looped-bfs checkpoints
layer inputs. **Our assumptions**, labelled in the rows: the pipeline sits inside a node (its sends on
NVLink) and data parallelism crosses nodes, so the network carries exactly the data-parallel traffic the
claims are about; "shortest training time" is read as the step time at the smallest batch per pipeline
that keeps it busy (m = p), where a time-minimising run at the critical batch size ends up; the
"commodity" network is 10× slower than HDR InfiniBand.

Data-parallel time: each chunk's bytes (fp32 reduce-scatter of its gradients; with ZeRO-3 also its bf16
weight gathers, one per run of consecutive actions on the chunk, as `WeightResidency` gathers them) go on
one lane per rank, started when the chunk's gradient is final (`looped.exposed_reduction`: REDUCE_GRAD
after the chunk's last backward, for the depth-first baselines too, i.e. DDP overlapped per chunk);
ZeRO-1's parameter all-gather after the optimizer step is exposed whole. Contention between the lane
and the pipeline's own sends is not modelled.
"""
from __future__ import annotations

from typing import Optional

from megatron_pp.planning.efficiency import BF16_BYTES, HardwareProfile, LayerShape, Roofline
from megatron_pp.planning.memory import (stage_parameters_per_gpu, stash_bytes, state_bytes_per_parameter,
                                         transient_activation_bytes)
from megatron_pp.planning.papers.common import (GB, PaperReport, Row, Setting, Trend, chunk_costs,
                                                load_hardware_profile, load_setting, relative_error)
from megatron_pp.planning.papers.small import SmallScale, simulated_bubble, tiny_config
from megatron_pp.schedules.comm import insert_communication
from megatron_pp.schedules.generators import interleaved_1f1b, one_f_one_b
from megatron_pp.schedules.ir import COMPUTE_OPS, Op, Schedule
from megatron_pp.schedules.looped import add_layered_reduction, exposed_reduction
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate

CONFIG = "breadth_first_52b"
DP = 8
"""The config's data-parallel size (pp 8 × dp 8 on 64 GPUs): global batch = m · DP at micro-batch 1."""
VARIANTS = ("looped-bfs", "interleaved-1f1b", "1f1b")
SLOW_NETWORK_FACTOR = 10
"""Our assumption for 'commodity' networking: 10× slower per GPU than the HDR InfiniBand of the A100
profile (2.5 GB/s per GPU, e.g. two 100 GbE ports shared by eight GPUs)."""


def _schedule(setting: Setting, m: int) -> Schedule:
    """The variant's lists at m microbatches, each chunk's reduction right after its last backward."""
    name, p, v = setting.args.pipeline_schedule, setting.pp, setting.chunks()
    if name == "looped-bfs":
        return build_schedule(name, p, m, v, layered_grad_accumulation=True)
    base = interleaved_1f1b(p, m, v) if name == "interleaved-1f1b" else one_f_one_b(p, m)
    return insert_communication(add_layered_reduction(base))


def weight_runs(actions) -> dict[int, int]:
    """Per local chunk, how many maximal runs of consecutive compute actions it has: how often sharded
    weights (ZeRO-3) gather it in a step (`training.layered.WeightResidency`)."""
    runs: dict[int, int] = {}
    previous = None
    for a in actions:
        if a.op in COMPUTE_OPS:
            if a.chunk != previous:
                runs[a.chunk] = runs.get(a.chunk, 0) + 1
            previous = a.chunk
    return runs


def _sharded(setting: Setting) -> bool:
    return setting.args.data_parallel_sharding_strategy == "optim_grads_params"


def dp_bytes(setting: Setting, m: int, sharded: Optional[bool] = None) -> float:
    """Bytes rank 0 sends on the data-parallel ring in one step (ring: (w − 1)/w of each buffer): the fp32
    gradient reduce-scatter of each chunk, plus bf16 weight gathers, one per run with sharded weights
    (ZeRO-3) or one after the optimizer step (ZeRO-1)."""
    sharded = _sharded(setting) if sharded is None else sharded
    schedule = _schedule(setting, m)
    runs = weight_runs(schedule.actions[0])
    ring = (setting.dp - 1) / setting.dp
    total = 0.0
    for spec in setting.stages(setting.chunks()):
        rank, chunk = schedule.placement[spec.stage]
        if rank != 0:
            continue
        params = stage_parameters_per_gpu(setting.config, spec, setting.tp)
        gathers = runs.get(chunk, 0) if sharded else 1
        total += params * (4 + BF16_BYTES * gathers) * ring
    return total


class Timed:
    """One variant at m microbatches, simulated once: its step time for any data-parallel link speed."""

    def __init__(self, setting: Setting, hw: HardwareProfile, m: int) -> None:
        specs = setting.stages(setting.chunks())
        shape = LayerShape.from_config(setting.config, setting.tp, setting.args.sequence_parallel)
        layer = Roofline(shape, hw, setting.attention).layer_times(setting.micro_batch)
        costs = chunk_costs(setting, hw, specs, layer, 1.0, False, recompute=setting.recompute)
        rows = setting.config.seq_length * setting.micro_batch
        latency = rows * setting.config.hidden_size * BF16_BYTES / (hw.tp_link_gbps * GB)  # pipeline in a node
        self.schedule = _schedule(setting, m)
        self.model = CostModel(measured=costs, p2p_latency=latency)
        self.sim = simulate(self.schedule, self.model)
        sharded, ring = _sharded(setting), (setting.dp - 1) / setting.dp
        runs = [weight_runs(actions) for actions in self.schedule.actions]
        self.lane_bytes, self.after_bytes = {}, [0.0] * setting.pp
        for spec in specs:
            rank, chunk = self.schedule.placement[spec.stage]
            params = stage_parameters_per_gpu(setting.config, spec, setting.tp)
            gathers = runs[rank].get(chunk, 0) if sharded else 0
            self.lane_bytes[spec.stage] = params * (4 + BF16_BYTES * gathers) * ring
            if not sharded:  # ZeRO-1: the updated weights are gathered after the optimizer step
                self.after_bytes[rank] += params * BF16_BYTES * ring

    def at(self, dp_gbps: float) -> dict:
        """{'step', 'bubble', 'exposed'} with data parallelism on `dp_gbps` GB/s per GPU (seconds)."""
        lanes = {stage: n / (dp_gbps * GB) for stage, n in self.lane_bytes.items()}
        exposed = exposed_reduction(self.schedule, lanes, self.model, result=self.sim, from_backward_start=True)
        extra = max(e + a / (dp_gbps * GB) for e, a in zip(exposed, self.after_bytes))
        return {"step": self.sim.makespan + extra, "bubble": self.sim.bubble_fraction, "exposed": extra}

    def needed_gbps(self, share: float = 0.05) -> float:
        """The slowest data-parallel link (GB/s per GPU) that leaves at most `share` of the step exposed."""
        low, high = 0.01, 10_000.0
        for _ in range(30):
            mid = (low * high) ** 0.5
            got = self.at(mid)
            low, high = (low, mid) if got["exposed"] <= share * got["step"] else (mid, high)
        return high


def load_variants(m: int) -> dict[str, Setting]:
    """The config's three variants at m microbatches per pipeline (global batch m · dp, micro-batch 1)."""
    variants = {v: load_setting(CONFIG, v, **{"global-batch-size": m * DP}) for v in VARIANTS}
    if any(s.dp != DP or s.microbatches != m for s in variants.values()):
        raise ValueError(f"launch/configs/{CONFIG}.yaml no longer has dp {DP} at micro-batch 1, which papers/layered.py "
                         "assumes")
    return variants


def _memory_gb(setting: Setting, m: int) -> dict:
    """Rank 0's memory in GB: parameters' state, gathered weights, checkpoints and one layer's internals.
    ZeRO-3 as the paper describes it shards all 18 bytes per parameter over dp (this repository still keeps
    full fp32 gradient buffers: docs/layered.md); ZeRO-1 shards the 12 bytes of Adam state and fp32 master."""
    schedule = _schedule(setting, m)
    mine = [s for s in setting.stages(setting.chunks()) if schedule.placement[s.stage][0] == 0]
    params = [stage_parameters_per_gpu(setting.config, s, setting.tp) for s in mine]
    w = setting.dp
    if _sharded(setting):
        state = sum(params) * 18 / w
        gathered = BF16_BYTES * sum(sorted(params)[-2:])  # at most two chunks' weights resident
    else:
        state = sum(params) * state_bytes_per_parameter(dp=w, distributed_optimizer=True)
        gathered = 0.0
    peak = simulate(schedule).peak_stash[0]  # rank 0's stashes (one per chunk and microbatch) at its peak
    common = dict(tp=setting.tp, sequence_parallel=setting.args.sequence_parallel, attention=setting.attention,
                  recompute=setting.recompute)
    stash = stash_bytes(setting.config, mine[1] if len(mine) > 1 else mine[0], setting.micro_batch, **common)
    checkpoints = peak * stash
    internals = transient_activation_bytes(setting.config, setting.micro_batch, **common)
    total = state + gathered + checkpoints + internals
    return {"state": state / GB, "gathered": gathered / GB, "activations": (checkpoints + internals) / GB,
            "total": total / GB}


def _network_rows(report: PaperReport, timed: dict, steps: dict, fast: float) -> None:
    """The network claim: the data-parallel link each variant needs, and its cost on a slower one."""
    names = {"looped-bfs": "layered + modular", "interleaved-1f1b": "interleaved 1F1B", "1f1b": "1F1B"}
    slow = fast / SLOW_NETWORK_FACTOR
    needed = {v: [timed[m][v].needed_gbps() for m in (8, 32)] for v in VARIANTS}
    report.rows.append(Row(
        "Network: slowest data-parallel link per GPU keeping exposed data-parallel time ≤ 5% of the step, "
        "m = 8 / 32",
        "qualitative (abstract: fast InfiniBand not necessary); no number published",
        "; ".join(f"{names[v]} {needed[v][0]:.1f} / {needed[v][1]:.1f} GB/s" for v in VARIANTS)
        + f" (HDR InfiniBand: {fast:.0f} GB/s)"))
    cost = {v: [timed[m][v].at(slow)["step"] / steps[m][v]["step"] - 1 for m in (8, 32)] for v in VARIANTS}
    report.rows.append(Row(
        f"Network: step time with data parallelism on {slow:.1f} instead of {fast:.0f} GB/s per GPU (our "
        f"{SLOW_NETWORK_FACTOR}× slower 'commodity' network), m = 8 / 32",
        "no number published",
        "; ".join(f"{names[v]} {100 * cost[v][0]:+.0f}% / {100 * cost[v][1]:+.0f}%" for v in VARIANTS)))


def predict_layered(hardware: str = "a100-80gb", quick: bool = False) -> PaperReport:
    hw, _ = load_hardware_profile(hardware)
    report = PaperReport(
        "layered", "Layered gradient accumulation and modular pipeline parallelism (Lamy-Poirier, arXiv 2106.02679)",
        f"no figure taken from the paper (its models, cluster and tables are not used here); every claim is "
        f"predicted on the 52B setting of {CONFIG}.yaml (pp 8 × dp 8, micro-batch 1), roofline on {hw.name} with "
        f"matmul efficiency {hw.matmul_efficiency}, pipeline inside a node and data parallelism across nodes "
        f"(our placement). Nothing fitted.")
    p, fast = 8, hw.pair_link_gbps
    sizes = (8,) if quick else (8, 16, 32)
    at = {m: load_variants(m) for m in sizes}
    timed = {m: {v: Timed(s, hw, m) for v, s in at[m].items()} for m in at}
    steps = {m: {v: t.at(fast) for v, t in timed[m].items()} for m in at}

    base = steps[p]
    halved = base["1f1b"]["step"] / base["looped-bfs"]["step"]
    report.rows.append(Row(
        "Shortest training time: 1F1B (contiguous stages, ZeRO-1) / layered + modular (looped-bfs, ZeRO-3), "
        "m = p = 8 (one sample per GPU; our reading of the shortest-time regime)",
        "halved, 2× (abstract)",
        f"{halved:.2f}× (step {base['1f1b']['step']:.2f} vs {base['looped-bfs']['step']:.2f} s; bubble "
        f"{100 * base['1f1b']['bubble']:.0f}% vs {100 * base['looped-bfs']['bubble']:.0f}%; exposed data-parallel "
        f"{1e3 * base['1f1b']['exposed']:.0f} vs {1e3 * base['looped-bfs']['exposed']:.0f} ms)",
        relative_error(halved, 2.0)))
    inter = base["interleaved-1f1b"]["step"] / base["looped-bfs"]["step"]
    report.rows.append(Row(
        "Same, against the looping placement run depth-first (interleaved 1F1B, ZeRO-1), m = 8",
        "no number published for this comparison",
        f"{inter:.2f}× (bubble {100 * base['interleaved-1f1b']['bubble']:.0f}% vs "
        f"{100 * base['looped-bfs']['bubble']:.0f}%)"))
    if not quick:
        larger = ", ".join(f"m = {m}: {steps[m]['1f1b']['step'] / steps[m]['looped-bfs']['step']:.2f}×"
                           for m in (16, 32))
        report.rows.append(Row("Gain over 1F1B at larger batches per pipeline", "no number published",
                               f"{larger} (the fill/drain bubble the modular pipeline removes shrinks as m grows)"))
    v = at[p]["looped-bfs"].chunks()
    formula = (p - 1) / (v * p + p - 1)
    report.rows.append(Row(
        f"Modular pipeline bubble, p = 8, v = {v}, m = 8",
        f"no number published; (p−1)/(v·m+p−1) = {100 * formula:.1f}% (our derivation for one layer per stage)",
        f"{100 * base['looped-bfs']['bubble']:.1f}% simulated (output layer and loss on the last stage, "
        f"embedding on the first)"))

    lists = {m: at.get(m) or load_variants(m) for m in (8, 16, 32)}  # list sizes only: no simulation
    layered = [dp_bytes(lists[m]["looped-bfs"], m) / GB for m in lists]
    depth3 = [dp_bytes(lists[m]["interleaved-1f1b"], m, True) / GB for m in lists]
    zero1 = [dp_bytes(lists[m]["interleaved-1f1b"], m, False) / GB for m in lists]
    fmt = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    report.rows.append(Row(
        "Data movement: data-parallel bytes sent per GPU per step, m = 8 / 16 / 32",
        "qualitative (abstract: less data movement); no number published",
        f"layered ZeRO-3 {fmt(layered)} GB; depth-first ZeRO-3 (interleaved 1F1B) {fmt(depth3)} GB; ZeRO-1 "
        f"{fmt(zero1)} GB"))

    if not quick:
        _network_rows(report, timed, steps, fast)

    mem = {name: _memory_gb(at[p][name], p) for name in ("looped-bfs", "1f1b")}
    share = mem["looped-bfs"]["total"] / (hw.memory_gib * 2 ** 30 / GB)
    report.rows.append(Row(
        "Memory with ZeRO: rank 0, m = 8 (state + gathered weights + activations)",
        "qualitative (abstract: a small fraction of GPU memory); no number published",
        f"layered ZeRO-3 {mem['looped-bfs']['state']:.1f} + {mem['looped-bfs']['gathered']:.1f} + "
        f"{mem['looped-bfs']['activations']:.1f} = {mem['looped-bfs']['total']:.1f} GB ({100 * share:.0f}% of the "
        f"GPU); 1F1B ZeRO-1 {mem['1f1b']['state']:.1f} + {mem['1f1b']['activations']:.1f} = "
        f"{mem['1f1b']['total']:.1f} GB"))
    report.notes += [
        "The paper's scaling-law analysis (critical batch size, shortest training time, 'no memory wall') is not "
        "modelled; the rows test the mechanisms it rests on at one assumed setting.",
        "ZeRO-3 memory is the paper's full sharding (18 bytes per parameter over dp); this repository's "
        "implementation still keeps full fp32 gradient buffers on every rank (docs/layered.md, Limitations).",
        "The +43% of the follow-up paper (arXiv 2211.05953) belongs to that paper: see the breadth-first section."]
    return report


def small_scale_layered(report: PaperReport, small: SmallScale, quick: bool = True) -> None:
    """The modular pipeline's bubble against v and layered accumulation's reduction count against m."""
    import statistics

    wide = tiny_config(hidden=256, heads=8, seq=128, vocab=2048)
    for v in ((1, 4) if quick else (1, 2, 4)):
        name = "1f1b" if v == 1 else "looped-bfs"
        options = {} if v == 1 else {"checkpoint_layer_inputs": False}
        measured = small.run(wide, name, 2, 4, v, options, 1, 3, world=2)
        bubble = statistics.median(1 - r["busy_s"] / r["wall_s"] for r in measured if r["wall_s"] > 0)
        predicted = simulated_bubble(name, 2, 4, v, options)
        report.trends.append(Trend(f"bubble vs v ({name})", f"pp 2, m 4, v {v}, h 256, s 128 (2 processes)",
                                   f"{100 * bubble:.0f}%", f"{100 * predicted:.0f}%", None))
    counts = []
    for m in (4, 8, 16):
        lists = build_schedule("looped-bfs", 4, m, 2, layered_grad_accumulation=True).actions
        counts.append(f"m={m}: {sum(a.op == Op.REDUCE_GRAD for a in lists[0])}")
    report.trends.append(Trend(
        "DP reductions per step vs m (layered accumulation)", "looped-bfs, pp 4, v 2, one group",
        "bytes measured by benchmarks/bench_layered.py traffic (docs/layered.md), not by this tool",
        "REDUCE_GRAD per rank in the lists: " + ", ".join(counts) + " (one per chunk: independent of m)"))
