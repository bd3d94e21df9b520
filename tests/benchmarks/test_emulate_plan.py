"""The planner's timeline emulated (megatron_pp/benchmarks/emulate_plan.py) and the emulated point-to-point
transfers it needs (`emulate.Emulator.transfer_end`): orderings and exact scalings, never wall-clock targets.
The emulated step is never shorter than the simulated one of the same lists and costs, whatever the load
(every emulated action lasts at least its cost and starts after what it depends on)."""
import os
import sys

import pytest
import torch

from megatron_pp.benchmarks.emulate import (Emulator, consumed_messages, cost_model, family_schedule, new_link_file,
                                            worker_emulate)
from megatron_pp.benchmarks.emulate_measure import measure
from megatron_pp.benchmarks.emulate_plan import early_receive_bytes, plan_case, rank_forward_s, run_plan_case, scaled
from megatron_pp.models.presets import get_preset
from megatron_pp.planning.cost import Evaluator
from megatron_pp.planning.efficiency import HARDWARE_PROFILES
from megatron_pp.planning.job import Cluster, Configuration, Job
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.simulate import CostModel, simulate
from tests.dist import pool, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _FakeExecutor:
    rank, comm, _wait_s = 1, None, 0.0
    handlers = {op: (lambda a: None) for op in (Op.F, Op.B, Op.BI, Op.BW, Op.OFFLOAD, Op.RELOAD, Op.EVICT, Op.LOAD)}


def test_transfer_end_is_a_link_that_moves_one_message_at_a_time():
    """Rank 0 posts its sends to rank 1 at 0 and 1 s; rank 1 posted the receives at 0.5 and 0.6 s; latency 2 s:
    the first starts when its receive is posted (0.5, in at 2.5), the second when the link is free (2.5, in
    at 4.5), though its send and receive were both posted at 1 s. The simulator would have 2 and 3."""
    schedule = family_schedule("1f1b", 2, 2)
    emulator = Emulator(_FakeExecutor(), schedule, CostModel(p2p_latency=2.0))
    emulator.sent = torch.zeros(2, 2, 2, dtype=torch.float64)
    emulator.sent[0, 1] = torch.tensor([0.0, 1.0])
    emulator._receives = {0: [0.5, 0.6]}
    assert emulator.transfer_end(0, 1) == pytest.approx(4.5) and emulator.transfer_end(0, 0) == pytest.approx(2.5)


def _zb_h1_plan():
    job = Job("gpt3-1.3b", get_preset("gpt3-1.3b"), 32)
    evaluator = Evaluator(job, Cluster(32, HARDWARE_PROFILES["a100-80gb"]))
    c = Configuration(1, 4, 8, 1, "none", "zb-h1")
    return evaluator, evaluator.evaluate(c, exact=True)


def test_a_plan_is_emulated_at_one_scale_of_the_planners_own_times():
    """Every time of the plan (compute per stage, copies, p2p latency) is multiplied by one factor, which makes
    the mean rank's forward share `unit_s`; the lists at that scale simulate to the planner's pipeline time
    times the factor, exactly (no extrapolation at exact=True), so the emulated step is held to the planner's
    own timeline."""
    evaluator, prediction = _zb_h1_plan()
    case = plan_case("gpt3-1.3b zb-h1", evaluator, prediction, 0.02)
    forward = rank_forward_s(case.schedule, case.costs)
    assert sum(forward) / len(forward) * case.scale == pytest.approx(0.02)
    model = scaled(case.costs, case.scale)
    assert case.costs.p2p_latency > 0 and model.p2p_latency == pytest.approx(case.scale * case.costs.p2p_latency)
    for stage in range(4):
        for op in (Op.F, Op.B, Op.BI, Op.BW):
            assert model.duration(op, stage) == pytest.approx(case.scale * case.costs.duration(op, stage))
    assert simulate(case.schedule, model).makespan == pytest.approx(case.scale * prediction.pipeline_s)
    assert len(case.after_s) == 4 and all(a > 0 for a in case.after_s)
    # gloo's receives posted ahead: zb-h1 keeps one per incoming link; a message is s·b·h bf16 values.
    assert case.message_bytes == 2048 * 2048 * 2
    assert early_receive_bytes(case) == [n * case.message_bytes for n in (1, 2, 2, 1)]


def test_emulated_transfers_start_after_both_posts_and_take_their_latency(tmp_path):
    """1F1B at p = 4, m = 8, a forward of 20 ms and a transfer of 5 ms: every consumer's input is in no
    earlier than its link's transfer end rebuilt from the recorded posts (send and receive both posted, the
    link free, plus the latency), and the step is no shorter than the simulated one with that latency."""
    schedule = family_schedule("1f1b", 4, 8)
    base = cost_model("equal", 0.02)
    costs = CostModel(forward=base.forward, backward=base.backward, p2p_latency=0.005)
    links = new_link_file(str(tmp_path), schedule)
    runs = run_distributed(4, worker_emulate, schedule, [costs], 2, links=links)
    step = [runs[r][0][1] for r in range(4)]
    checked = 0
    for rank, record in enumerate(step):
        sends = {peer: [w for kind, p, w in runs[peer][0][1]["posts"] if kind == "send" and p == rank]
                 for peer in (rank - 1, rank + 1) if 0 <= peer < 4}
        recvs = {peer: [w for kind, p, w in record["posts"] if kind == "recv" and p == peer] for peer in sends}
        compute = {label: (begin, waited) for label, begin, _, waited, *_ in record["compute"]}
        for label, inputs in consumed_messages(schedule, rank).items():
            for peer, k in inputs:
                end = 0.0
                for j in range(k + 1):
                    end = max(sends[peer][j], recvs[peer][j], end) + 0.005
                begin, waited = compute[label]
                assert begin + waited >= end - 1e-6, (rank, label)
                checked += 1
    assert checked == sum(a.op in (Op.RECV_F, Op.RECV_B) for acts in schedule.actions for a in acts)
    assert measure(step)["step_s"] >= simulate(schedule, costs).makespan


def test_an_emulated_plan_is_never_faster_than_its_simulated_lists():
    """The zb-h1 plan above (p = 4, m = 4) at 5 ms a forward share: the row reads the emulated step back at
    real scale, no shorter than the exact simulation of the same lists, and its critical path holds the
    planner's latency once per hop it crosses."""
    evaluator, prediction = _zb_h1_plan()
    case = plan_case("gpt3-1.3b zb-h1", evaluator, prediction, 0.005)
    row = run_plan_case(pool(4), case, 1, log=lambda line: None)
    assert row["emulated_pipeline_s"] >= row["simulated_pipeline_s"] * (1 - 1e-9)
    assert row["emulated_step_s"] >= row["emulated_pipeline_s"]
    assert row["predicted_step_s"] == prediction.step_s and row["microbatches"] == 4
    path = row["critical_path_ms"]
    hops = path["latency"] / (1e3 * case.scale * case.costs.p2p_latency)
    assert hops == pytest.approx(round(hops)) and round(hops) >= 1


def test_plan_bad_input_is_one_line(capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import trace_vs_sim

    assert trace_vs_sim.main(["--plan", "--model-preset gpt3-1.3b"]) == 2
    assert trace_vs_sim.main(["--emulate", "--plan", "--model-preset no-such --global-batch-size 8 --num-gpus 8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "trace_vs_sim.py: error: --plan needs --emulate"
    assert err[-1].startswith("trace_vs_sim.py: error: --plan ") and "no-such" in err[-1]
