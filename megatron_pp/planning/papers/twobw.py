"""PipeDream-2BW (arXiv 2006.09503): its throughput and memory claims at full scale from the paper's
configs, and the small-scale stash and step-time trends through the real training loop."""
from __future__ import annotations

import statistics

from megatron_pp.planning.efficiency import HardwareProfile, LayerShape, Roofline
from megatron_pp.planning.memory import stage_state_bytes, stash_bytes, transient_activation_bytes
from megatron_pp.planning.papers.common import (GB, GIB, PaperReport, Row, Setting, Trend, gb_text, chunk_costs,
                                                load_hardware_profile, load_setting, relative_error)
from megatron_pp.planning.papers.small import SmallScale, ratio_trend, predicted_stash_peaks, tiny_config
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate




def _2bw_step(setting: Setting, hw: HardwareProfile, method: str) -> tuple[float, float]:
    """(seconds per optimizer step, bubble) of `method` ('2bw', '1f1b', 'gpipe') for a 2BW config: the
    simulated pipeline (2BW: the steady period between steps) plus the data-parallel all-reduce of the
    stage's fp16 gradients, exposed after the flush for Flush and GPipe and hidden behind the next step's
    compute for 2BW when shorter (the paper's throughput model takes max(compute, DP/m))."""
    shape = LayerShape.from_config(setting.config, 1, False)
    layer = Roofline(shape, hw, "unfused").layer_times(setting.micro_batch)
    specs = setting.stages()
    costs = chunk_costs(setting, hw, specs, layer, 1.0, False, recompute="full")
    # Replicas of a stage share a server (the paper's placement when w <= 8), so the pipeline crosses
    # servers: each boundary activation goes over the network link.
    boundary = 2 * setting.config.seq_length * setting.micro_batch * setting.config.hidden_size  # fp16 bytes
    latency = boundary / (hw.pair_link_gbps * GB)
    model = CostModel(measured=costs, p2p_latency=latency)
    p, m = setting.pp, setting.microbatches
    if method == "2bw":
        one = simulate(build_schedule("2bw", p, m, steps=1), model).makespan
        three = simulate(build_schedule("2bw", p, m, steps=3), model).makespan
        pipeline = (three - one) / 2
    else:
        pipeline = simulate(build_schedule(method, p, m), model).makespan
    params = max(stage_state_bytes(setting.config, s, tp=1, dp=1) / 18 for s in specs)
    w = setting.dp
    dp_s = 2 * (w - 1) / w * params * 2 / (hw.tp_link_gbps * GB) if w > 1 else 0.0
    step = max(pipeline, dp_s) if method == "2bw" else pipeline + dp_s
    busy = m * max(costs[(Op.F, s)] + costs[(Op.B, s)] for s in range(p))
    return step, 1 - busy / step


def predict_2bw(hardware: str = "v100-16gb-p3.16xlarge") -> PaperReport:
    hw, raw = load_hardware_profile(hardware, "fp16")
    report = PaperReport(
        "2bw", "PipeDream-2BW, GPT 2.2B / 3.8B on 64 V100-16GB (Narayanan et al., ICML 2021)",
        f"no absolute baseline figure taken from the paper; roofline on {hw.name} (fp16 {hw.peak_tflops:g} "
        f"TFLOP/s) with matmul efficiency {hw.matmul_efficiency} (the paper's ≈45 TFLOP/s per worker on "
        "GPT-355M). Nothing fitted.")
    for model in ("2.2b", "3.8b"):
        s = load_setting(f"pipedream_2bw_gpt_{model}", "2bw")
        times = {meth: _2bw_step(s, hw, meth) for meth in ("2bw", "1f1b", "gpipe")}
        ratio = times["1f1b"][0] / times["2bw"][0]
        report.rows.append(Row(f"GPT {model.upper()}, d={s.pp} w={s.dp} m={s.microbatches}: 2BW / PipeDream-Flush "
                               "throughput", "up to 1.6× (at low batch; Fig. 6)", f"{ratio:.2f}× (Flush bubble "
                               f"{100 * times['1f1b'][1]:.0f}%)", relative_error(ratio, 1.6)))
        ratio = times["gpipe"][0] / times["2bw"][0]
        report.rows.append(Row(f"GPT {model.upper()}: 2BW / GPipe throughput", "up to 3.2× (Fig. 6)", f"{ratio:.2f}×",
                               relative_error(ratio, 3.2)))
    # Figure 7: memory on one server.
    s = load_setting("pipedream_2bw_gpt_2.2b_1node", "2bw")
    specs = s.stages()
    worst = {}
    for method, stashes, extra in (("pipedream-flush", s.pp, 0), ("2bw", s.pp, 4), ("gpipe", s.microbatches, 0)):
        per_stage = []
        for spec in specs:
            params = stage_state_bytes(s.config, spec, tp=1, dp=1) / 18
            act = stash_bytes(s.config, spec, s.micro_batch, attention="unfused", recompute="full")
            transient = transient_activation_bytes(s.config, s.micro_batch, attention="unfused", recompute="full")
            count = min(s.pp - spec.stage, s.microbatches) if method != "gpipe" else stashes
            per_stage.append(params * (18 + extra) + count * act + transient)
        worst[method] = max(per_stage)
    for method, published in (("pipedream-flush", 6.0), ("2bw", 9.0)):
        report.rows.append(Row(f"GPT 2.2B on 8 V100, worst-worker memory, {method} (b=8, m=8)",
                               f"≈ {published:g} GB (Fig. 7, read from a figure)", gb_text(worst[method]),
                               relative_error(worst[method] / GB, published)))
    report.rows.append(Row("GPT 2.2B on 8 V100, GPipe (b=8, m=8)", "OOM at batch 64, ≈ 15 GB at 256 (Fig. 7)",
                           f"{gb_text(worst['gpipe'])}, {'fits' if worst['gpipe'] <= hw.memory_gib * GIB else 'OOM'} "
                           "in 16 GB"))
    report.notes.append("2BW's second version is counted as a second fp32 master (+4 bytes per parameter, as "
                        "the public 2BW code, msr-fiddle/pipedream, keeps two); optimizer state 18 bytes per "
                        "parameter (fp16 weights, fp32 gradients, master and two Adam moments).")
    return report


def small_scale_2bw(report: PaperReport, small: SmallScale, quick: bool = True) -> None:
    """2BW's stash and step-time trends at small scale (training loop)."""
    cfg = tiny_config()
    tiny = ["--model-preset", "gpt-tiny", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "256", "--mock-data",
            "--lr", "1e-4", "--log-interval", str(10 ** 6), "--micro-batch-size", "1"]
    peaks = {}
    for name in ("1f1b", "2bw"):
        rows = small.train(tiny + ["--pipeline-model-parallel-size", "4", "--global-batch-size", "4",
                                   "--train-iters", "3", "--pipeline-schedule", name], pp=4, world=4)
        measured = [float(b) for b in rows[-1]["peak_stash_bytes"]]
        predicted = predicted_stash_peaks(cfg, name, 4, 4, 1, {}, 1)
        errors = [relative_error(pr, me) for pr, me in zip(predicted, measured) if me]
        report.trends.append(Trend(f"2BW: peak stash per rank, {name} (training loop)", "pp 4, m 4 = p, b 1",
                                   " / ".join(f"{x / 1024:.0f}" for x in measured) + " KiB",
                                   " / ".join(f"{x / 1024:.0f}" for x in predicted) + " KiB",
                                   max(errors, key=abs) if errors else None))
        peaks[name] = (max(measured), max(predicted))
    ratio_trend(report, "2BW: worst-rank stash, 2BW / Flush at m = p (weights excluded)", "pp 4, m 4",
                 peaks["2bw"], peaks["1f1b"])
    # Step time at m = p on 2 processes (one per vCPU of a small machine), larger layers so that
    # compute dominates the per-action overheads.
    wide = ["--model-preset", "gpt-tiny", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
            "--ffn-hidden-size", "1024", "--seq-length", "128", "--max-position-embeddings", "128",
            "--vocab-size", "2048", "--mock-data", "--lr", "1e-4", "--log-interval", str(10 ** 6),
            "--micro-batch-size", "2", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    iterations = 6 if quick else 10
    ratios = []
    for round_ in range(1 if quick else 3):
        step = {}
        for name in (("1f1b", "2bw") if round_ % 2 == 0 else ("2bw", "1f1b")):
            rows = small.train(wide + ["--train-iters", str(iterations), "--pipeline-schedule", name],
                               pp=2, world=2)
            step[name] = statistics.median(r["step_time_s"] for r in rows[2:-1])
        ratios.append(step["1f1b"] / step["2bw"])
    one = simulate(build_schedule("2bw", 2, 2, steps=1)).makespan
    three = simulate(build_schedule("2bw", 2, 2, steps=3)).makespan
    flush = simulate(build_schedule("1f1b", 2, 2)).makespan
    predicted = flush / ((three - one) / 2)
    measured = statistics.median(ratios)
    report.trends.append(Trend("2BW vs Flush: step time ratio Flush / 2BW at m = p",
                               f"pp 2, m 2, b 2, h 256, s 128; median of {len(ratios)} paired round(s)",
                               f"{measured:.2f}×", f"{predicted:.2f}× (simulated, F:B = 1:2)",
                               relative_error(predicted, measured)))
