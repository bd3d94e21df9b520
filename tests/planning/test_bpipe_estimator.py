"""The BPipe estimator: stash counts against closed forms and the simulator, the roofline, measured
curves, the transfer check, and the qualitative result of the re-evaluation on fixed inputs.

The qualitative inputs are documented, not tuned: one 8-GPU A100-80GB node (the hardware of both papers),
pp = 8, tp = 1, dp = 1, global batch 128 sequences; GPT-3 13B as published (Brown et al. 2020, Table 2.1:
40 layers, hidden 5120, 40 heads, sequence 2048) with Megatron-LM's default dropout 0.1, and LLaMA-2 13B
as released (sequence 4096, no dropout); recompute on/off (none, full), as in the papers' framing; the
roofline of `planning.efficiency` (datasheet numbers); the default 10% memory reserve.
"""
import dataclasses
import math
import os
import sys

import pytest

from megatron_pp.models.presets import get_preset
from megatron_pp.planning.bpipe_estimator import Job, efficiency_model, estimate, layouts, one_f_one_b_stashes
from megatron_pp.planning.efficiency import (A100_80GB, BENCH_FORMAT, LayerShape, MeasuredCurve, Roofline, head_times,
                                             kernels, load_hardware)
from megatron_pp.planning.memory import stage_state_bytes, stash_bytes, transient_activation_bytes
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.simulate import CostModel, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import estimate_bpipe  # noqa: E402


@pytest.mark.parametrize("p,m", [(4, 4), (4, 8), (5, 3), (6, 12), (8, 8)])
def test_one_f_one_b_stashes_match_the_simulator(p, m):
    assert one_f_one_b_stashes(p, m) == [min(p - s, m) for s in range(p)]
    assert simulate(build_schedule("1f1b", p, m)).peak_stash == one_f_one_b_stashes(p, m)


def _job(preset, attention, dropout, **kw):
    config = dataclasses.replace(get_preset(preset), hidden_dropout=dropout, attention_dropout=dropout)
    return Job(config, kw.pop("tp", 1), kw.pop("pp", 8), kw.pop("dp", 1), kw.pop("global_batch_size", 128),
               attention, **kw)


def _estimate(job, hardware=A100_80GB, recompute=("none", "full"), **kw):
    return estimate(job, hardware, efficiency_model(job, hardware), recompute_options=recompute,
                    max_micro_batch_size=2, **kw)


def test_qualitative_gpt3_without_flash_gains_flash_and_llama_do_not():
    gpt_unfused = _estimate(_job("gpt3-13b", "unfused", 0.1))
    # 1F1B cannot hold 8 unfused stashes on stage 0 (the b·a·s² score tensors), so it must recompute;
    # BPipe with K = 6 (the loosest bound that fits) holds 7 there and drops recomputation.
    plain, bpipe = gpt_unfused.best_plain, gpt_unfused.best_bpipe
    assert (plain.micro_batch_size, plain.recompute) == (1, "full")
    assert (bpipe.micro_batch_size, bpipe.recompute, bpipe.resident_bound) == (1, "none", 6)
    assert bpipe.transfer_overhead_s == 0.0  # one node: 5.6 GB per stash over NVLink hides behind F + B
    assert gpt_unfused.speedup == pytest.approx(1.30, abs=0.01) and gpt_unfused.turn_on
    none_plain = next(c for c in gpt_unfused.candidates
                      if c.recompute == "none" and not c.bpipe and c.micro_batch_size == 1)
    assert not none_plain.fits and none_plain.worst_stage == 0

    # With flash attention the same model fits without recomputation under plain 1F1B: nothing to gain.
    gpt_flash = _estimate(_job("gpt3-13b", "flash", 0.1))
    assert gpt_flash.best_plain.recompute == "none" and gpt_flash.speedup == 1.0 and not gpt_flash.turn_on
    llama = _estimate(_job("llama2-13b", "flash", 0.0))
    assert llama.best_plain.recompute == "none" and llama.speedup == 1.0 and not llama.turn_on

    # Selective recomputation already removes the score tensors for a few percent: the gain shrinks to that.
    selective = _estimate(_job("gpt3-13b", "unfused", 0.1), recompute=("none", "selective", "full"))
    assert selective.best_plain.recompute == "selective"
    assert 1.0 < selective.speedup < 1.1


def test_bpipe_memory_is_what_the_pass_holds():
    """The BPipe peaks are the simulated `bpipe` lists weighed in bytes: stage 0 holds K + 1 of its own
    stashes (the forward that exceeds the bound), stage 7 its own one plus the 8 − K = 2 that stage 0
    parks, at stage 0's size."""
    job = _job("gpt3-13b", "unfused", 0.1)
    e = _estimate(job)
    c = next(c for c in e.candidates if c.bpipe and c.recompute == "none" and c.micro_batch_size == 1)
    K, stages = c.resident_bound, job.stages
    stash = [stash_bytes(job.config, spec, 1, attention="unfused") for spec in stages]
    state = [stage_state_bytes(job.config, spec) for spec in stages]
    transient = transient_activation_bytes(job.config, 1, attention="unfused")
    assert K == 6
    assert c.stage_peak_bytes[0] == pytest.approx(state[0] + (K + 1) * stash[0] + transient)
    assert c.stage_peak_bytes[7] == pytest.approx(state[7] + stash[7] + (8 - K) * stash[0] + transient)
    # 1F1B itself is `min(p - s, m)` stashes per stage.
    plain = next(p for p in e.candidates if not p.bpipe and p.recompute == "none" and p.micro_batch_size == 1)
    assert plain.stage_peak_bytes == pytest.approx(
        [state[s] + n * stash[s] + transient for s, n in enumerate(one_f_one_b_stashes(8, 128))])


def test_transfers_over_the_network_are_charged():
    """Split over two 4-GPU nodes, pairs (x, 7 - x) talk over HDR InfiniBand: a stage-0 stash takes
    longer to send than stage 0 computes per microbatch. In the simulated `bpipe` lists each forward then
    waits for the eviction that makes room for it and, since the acceptor holds no spare buffer beyond its
    list's guests, for the return that frees the acceptor's buffer first: about `m − K` times
    (two transfers − the stage's compute) per step."""
    # At peak matmul rate (efficiency 1) a stage computes fastest, so the copies dominate it clearly and the
    # `m − K` rule below holds closely; with the profile's achieved efficiency the gap narrows.
    two_nodes = dataclasses.replace(A100_80GB, gpus_per_node=4, matmul_efficiency=1.0)
    job = _job("gpt3-13b", "unfused", 0.1)
    e = _estimate(job, two_nodes)
    c = next(c for c in e.candidates if c.bpipe and c.recompute == "none" and c.micro_batch_size == 1)
    plain = next(p for p in e.candidates if not p.bpipe and p.recompute == "none" and p.micro_batch_size == 1)
    assert c.resident_bound == 6 and c.transfer_overhead_s == pytest.approx(c.step_s - plain.step_s)
    layer = efficiency_model(job, two_nodes).layer_times(1)
    stage0 = job.stages[0].num_layers * (layer.forward_s + layer.backward_s)
    transfer = stash_bytes(job.config, job.stages[0], 1, attention="unfused") / (two_nodes.pair_link_gbps * 1e9)
    assert transfer > stage0
    assert c.transfer_overhead_s == pytest.approx((128 - 6) * (2 * transfer - stage0), rel=0.1)
    # Slower than recomputing: BPipe's best is then full recomputation with the loosest real bound (K = p − 1,
    # whose few small stashes hide behind compute), no faster than 1F1B itself: the answer is off.
    assert e.best_bpipe.recompute == "full" and e.best_bpipe.resident_bound == 7
    assert e.speedup <= 1.0 and not e.turn_on


def test_the_estimator_can_say_bpipe_loses_and_wins():
    """The answer is not forced by the candidate set (K = p, plain 1F1B, is never a BPipe candidate). GPT-3
    13B without flash attention on two 4-GPU nodes: on a GPU large enough for 1F1B without recomputation
    (141 GiB, an H200's memory), BPipe's evictions of 5.6 GB stashes cross the network slower than a stage
    computes and lengthen the step: S < 1, off. On an 80 GB GPU 1F1B must recompute and BPipe lets it stop:
    S > 1, on."""
    two_nodes = dataclasses.replace(A100_80GB, gpus_per_node=4)
    job = _job("gpt3-13b", "unfused", 0.1)
    loses = _estimate(job, two_nodes, gpu_memory_gib=141)
    assert loses.best_plain.recompute == "none" and loses.best_bpipe.resident_bound < 8
    assert loses.speedup < 1.0 and not loses.turn_on
    evicting = next(c for c in loses.candidates if c.bpipe and c.recompute == "none")
    assert evicting.transfer_overhead_s > 0 and evicting.step_s > loses.best_plain.step_s
    wins = _estimate(job, two_nodes, pairs_on_node=True)
    assert wins.best_plain.recompute == "full" and wins.best_bpipe.recompute == "none"
    assert wins.speedup > 1.0 and wins.turn_on


def test_the_verdict_compares_against_an_independent_1f1b_estimate():
    """The 1F1B side of S is the simulated 1F1B lists, not a BPipe candidate: at every (b, recompute) BPipe is
    never faster than 1F1B (same F/B order, transfers can only add), so S > 1 only when BPipe makes a faster
    configuration fit, and a tie (nothing evicts, or every transfer hides) is an 'off'."""
    job = _job("gpt3-13b", "unfused", 0.1)
    e = _estimate(job, recompute=("none", "selective", "full"))
    by = {}
    for c in e.candidates:
        by.setdefault((c.micro_batch_size, c.recompute), {})[c.bpipe] = c
    for pair in by.values():
        assert pair[True].resident_bound < job.pp and pair[True].step_s >= pair[False].step_s
    layer = efficiency_model(job, A100_80GB).layer_times(1)
    head_f, head_b = head_times(job.config, 1, job.tp, False, A100_80GB)
    costs = {}
    for spec in job.stages:
        costs[(Op.F, spec.stage)] = spec.num_layers * layer.forward_s + (head_f if spec.has_head else 0.0)
        costs[(Op.B, spec.stage)] = (spec.num_layers * (layer.compute_s("selective") - layer.forward_s)
                                     + (head_b if spec.has_head else 0.0))
    latency = 1 * 2048 * 5120 * 2 / (A100_80GB.tp_link_gbps * 1e9)
    direct = simulate(build_schedule("1f1b", 8, 128), CostModel(measured=costs, p2p_latency=latency)).makespan
    assert (e.best_plain.micro_batch_size, e.best_plain.recompute) == (1, "selective")
    assert e.best_plain.step_s == pytest.approx(direct, rel=1e-12)


def test_roofline_kernels_and_flat_mfu():
    config = dataclasses.replace(get_preset("gpt3-175b"), hidden_dropout=0.1, attention_dropout=0.1)
    shape = LayerShape.from_config(config, tp=8)
    fwd, bwd, core = kernels(shape, 1, "unfused")
    qkv = next(k for k in fwd if k.name == "qkv")
    assert qkv.flops == 2 * 2048 * 12288 * 3 * 12288 / 8
    assert sum(k.flops for k in fwd) == shape.forward_model_flops(1)  # unfused executes the full square
    assert sum(k.flops for k in bwd) == 2 * shape.forward_model_flops(1)
    # The unfused core is memory-bound: its kernels take longer than their FLOPs at peak would.
    assert sum(k.seconds(A100_80GB) for k in core) > sum(k.flops for k in core) / 312e12 * 2
    unfused, flash = Roofline(shape, A100_80GB, "unfused"), Roofline(shape, A100_80GB, "flash")
    # Every kernel of a 2048-token layer scales with b: the roofline's MFU(b) is flat.
    assert unfused.layer_times(4).mfu(312) == pytest.approx(unfused.layer_times(1).mfu(312), rel=1e-9)
    assert 0.5 < unfused.layer_times(1).mfu(312) < flash.layer_times(1).mfu(312) < 1
    times = unfused.layer_times(1)
    assert times.compute_s("full") == pytest.approx(times.compute_s("none") + times.forward_s)


def _report(shape, rows):
    return {"format": BENCH_FORMAT, "device": {"type": "cuda", "name": "test"}, "layer": dataclasses.asdict(shape),
            "results": [{"backend": "reference", "micro_batch_size": b, "forward_ms": f, "backward_ms": 2 * f,
                         "core_forward_ms": f / 10, "forward_flops": 1e12, "backward_flops": 2e12,
                         "core_forward_flops": 1e11} for b, f in rows]}


def test_measured_curve_interpolates_and_scales():
    job = _job("gpt3-13b", "unfused", 0.1)
    # Forward FLOPs 1e12 measured in 10 ms at b = 1 and 5 ms at b = 4: 100 and 200 TFLOP/s.
    curve = MeasuredCurve(_report(job.shape, [(1, 10.0), (4, 5.0)]), job.shape, "unfused", A100_80GB)
    assert curve.warnings == []
    flops = job.shape.forward_model_flops
    assert curve.layer_times(1).forward_s == pytest.approx(flops(1) / 100e12)
    assert curve.layer_times(2).forward_s == pytest.approx(flops(2) / (100e12 + 100e12 / 3))  # linear in b
    assert curve.layer_times(8).forward_s == pytest.approx(flops(8) / 200e12)  # clamped beyond the data
    other = LayerShape.from_config(get_preset("gpt3-175b"), 8)
    scaled = MeasuredCurve(_report(other, [(1, 10.0)]), job.shape, "unfused", A100_80GB)
    assert "scaled by FLOPs" in scaled.warnings[0]
    with pytest.raises(ValueError, match="no measurement for flash"):
        MeasuredCurve(_report(job.shape, [(1, 10.0)]), job.shape, "flash", A100_80GB)


def test_layouts_and_hardware_file(tmp_path):
    config = get_preset("gpt3-13b")
    assert layouts(config, 8) == [(1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 2, 2), (2, 4, 1), (4, 2, 1)]
    path = tmp_path / "gpu.json"
    path.write_text('{"name": "x", "peak_tflops": 100, "memory_gib": 40, "hbm_gbps": 1000, '
                    '"tp_link_gbps": 100, "pair_link_gbps": 10}')
    assert load_hardware(str(path)).memory_gib == 40
    path.write_text('{"name": "x", "peak": 1}')
    with pytest.raises(ValueError, match="unknown hardware fields"):
        load_hardware(str(path))


BAD = [
    (["--model-preset", "gpt3-13x", "--global-batch-size", "8"], "unknown model preset"),
    (["--model-preset", "gpt3-13b", "--global-batch-size", "8", "--pp", "7"], "not divisible by 7"),
    (["--model-preset", "gpt3-13b", "--global-batch-size", "9", "--dp", "2"], "--global-batch-size 9"),
    (["--model-preset", "gpt3-13b", "--global-batch-size", "8", "--tp", "3"], "--tensor-model-parallel-size 3"),
    (["--model-preset", "gpt3-13b", "--global-batch-size", "8", "--hardware", "tpu"], "unknown hardware"),
    (["--model-preset", "gpt3-13b", "--global-batch-size", "8", "--efficiency-file", "/nonexistent.json"],
     "--efficiency-file"),
    (["--model-preset", "gpt3-13b", "--global-batch-size", "8", "--recompute-options", "some"], "recompute option"),
    (["--model-preset", "gpt3-13b", "--global-batch-size", "eight"], "invalid int value"),
    (["--global-batch-size", "8"], "--model-preset"),
    (["--config", "launch/configs/bpipe_gpt3_96b.yaml", "--pp", "4"], "--config sets the model"),
    (["--config", "launch/configs/bpipe_gpt3_96b.yaml", "--variant", "zb"], "has no variant 'zb'"),
    (["--config", "launch/configs/no_such.yaml"], "no_such.yaml"),
    (["--model-preset", "gpt3-13b", "--global-batch-size", "8", "--variant", "1f1b"], "--variant needs --config"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        code = estimate_bpipe.main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_cli_answers_with_numbers(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    argv = ["--model-preset", "gpt3-13b", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--pp", "8",
            "--global-batch-size", "128", "--gpu-memory-gb", "80", "--attention-backend", "reference",
            "--recompute-options", "none,full", "--max-micro-batch-size", "1", "--json", str(out)]
    assert estimate_bpipe.main(argv) == 0
    text = capsys.readouterr().out
    assert "best 1F1B : b=1 m=128 recompute=full" in text
    assert "best BPipe: b=1 m=128 recompute=none K=6" in text
    assert "predicted speedup S = 1.297 = per-sample compute 1.295" in text and "answer: turn BPipe ON" in text
    import json
    (report,) = json.loads(out.read_text())
    assert report["turn_on"] and math.isclose(report["speedup"], 1.30, abs_tol=0.01)
    assert len(report["candidates"]) == 4  # b = 1 x (none, full) x (1F1B, BPipe)


def test_cli_takes_the_papers_assumptions_from_their_launch_config(capsys, monkeypatch):
    """`--config` reads model, layout, batch and attention from the YAML tools/reproduce.py uses, so docs/bpipe.md
    and the reproduction table share one set of assumptions (here BPipe's assumed GPT-3 96B, tp 4 x pp 12)."""
    monkeypatch.chdir(ROOT)
    argv = ["--config", "launch/configs/bpipe_gpt3_96b.yaml", "--variant", "1f1b", "--recompute-options", "full",
            "--max-micro-batch-size", "1"]
    assert estimate_bpipe.main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("BPipe estimate: 84 layers, hidden 9728, 76 heads (76 kv groups), seq 2048, "
                           "dropout 0.1/0.1; tp 4 x pp 12 x dp 1, global batch 128, sequence parallel\n"
                           "attention: unfused;")
    assert "best 1F1B : b=1 m=128 recompute=full  step 24.91 s" in text  # the reproduction table's `1f1b` row
