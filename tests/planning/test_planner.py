"""The planner: its memory never over the budget, its stash model against the executor's measured peaks,
launch flags the training parser accepts, plugins planned without planner changes, and the bookkeeping
(byte-weighted stash curves, extension in m) against the simulator itself."""
import dataclasses
import json
import os
import sys

import pytest

from megatron_pp.models.presets import get_preset
from megatron_pp.planning.efficiency import A100_80GB, HardwareProfile
from megatron_pp.planning.memory import state_bytes_per_parameter
from megatron_pp.planning.cost import Evaluator, list_order_peaks, live_weight_versions, resident_peaks
from megatron_pp.planning.job import Cluster, Configuration, Job
from megatron_pp.planning.planner import Planner
from megatron_pp.planning.report import launch_command, launch_flags
from megatron_pp.schedules.generators import gpipe, looped_placement, one_f_one_b
from megatron_pp.schedules.ir import TRANSFER_OPS, Action, Op, Schedule
from megatron_pp.schedules.peer_store import parking_pairs
from megatron_pp.schedules.registry import (build_schedule, register_schedule, registered_schedules,
                                            unregister_schedule)
from megatron_pp.schedules.runtime import hosting_bound
from megatron_pp.schedules.simulate import CostModel, simulate
from megatron_pp.training.arguments import build_parser, validate_args
from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan as plan_tool  # noqa: E402

MEMORY_TOLERANCE = 0.05  # the target for the memory model against measured peaks
# A CPU "cluster" for the executor comparison: only the memory matters there, so it is generous and the
# speeds are placeholders (the timing validation is tools/validate_planner.py, with measured numbers).
CPU = HardwareProfile("cpu (test)", peak_tflops=0.05, memory_gib=64, hbm_gbps=10, tp_link_gbps=5, pair_link_gbps=5,
                      gpus_per_node=64)


def _options(entry, v):
    """Defaults, plus one offloaded chunk where the schedule offers offload."""
    return {"offload_chunks": 1} if "offload_chunks" in entry.options else {}


# Bookkeeping against the simulator ------------------------------------------------------------------------


def test_byte_weighted_curves_reproduce_the_simulator_for_every_registered_schedule():
    """Unit bytes give back `SimResult.peak_stash` (with transfers timed unevenly; BPipe's acceptors within
    their hosting bound above it), and without transfers the list walk equals the timed curve."""
    costs = CostModel(forward=1.0, backward=2.0, backward_input=1.5, backward_weight=0.5,
                      stage_weights=None, p2p_latency=0.3, transfer=0.7)
    checked = []
    for entry in registered_schedules():
        for p, m in ((4, 8), (3, 6)):
            v = 2 if entry.supports_virtual else 1
            try:
                schedule = build_schedule(entry.name, p, m, v, **_options(entry, v))
            except ValueError:
                continue  # a size this schedule refuses
            sim = simulate(schedule, costs)
            ones = [1.0] * schedule.num_stages
            charged = resident_peaks(schedule, sim, ones)
            for rank, acts in enumerate(schedule.actions):
                if any(a.op is Op.ACCEPT for a in acts):
                    # A BPipe acceptor frees a guest at its partner's pace: charged at least the simulated
                    # peak, at most its own stashes plus its list's hosting bound.
                    bound = hosting_bound(acts)
                    assert sim.peak_stash[rank] <= charged[rank] <= sim.peak_stash[rank] + bound, (entry.name, rank)
                else:
                    assert charged[rank] == sim.peak_stash[rank], (entry.name, p, m, rank)
            if not any(a.op in TRANSFER_OPS for acts in schedule.actions for a in acts):
                assert list_order_peaks(schedule, ones) == sim.peak_stash, (entry.name, p, m)
            checked.append(entry.name)
    assert {"1f1b", "gpipe", "interleaved-1f1b", "po-h"} <= set(checked)


def test_deferred_backward_is_timed_apart_and_holds_its_bytes_until_bw():
    """Where a list splits the backward, BW costs the weight-gradient GEMMs and BI the rest (their sum is the
    whole backward); a stash whose BW runs apart from its BI changes by its stage's held bytes from BI to BW
    (less: BI frees more than the output gradients BW keeps), in the list walk and the timed curve alike,
    and a BW right after its BI (GIS) changes nothing."""
    job = Job("gpt3-1.3b", get_preset("gpt3-1.3b"), 64)
    evaluator = Evaluator(job, Cluster(8, A100_80GB))
    c = Configuration(1, 4, 2, 1, "none", "zb-h1")
    stash = evaluator.stage_stash_bytes(c)
    costs = evaluator.costs(c, stash)
    for s in range(4):
        bi, bw, b = (costs.duration(op, s) for op in (Op.BI, Op.BW, Op.B))
        assert 0 < bw < bi and bi + bw == pytest.approx(b)
    held = evaluator.stage_held_bytes(c)
    assert all(h < 0 for h in held)
    schedule = build_schedule("zb-h1", 4, 8)
    walked, unsplit = list_order_peaks(schedule, stash, held), list_order_peaks(schedule, stash)
    assert walked == resident_peaks(schedule, simulate(schedule, costs), stash, held)
    assert walked[0] == unsplit[0] and all(w < p for w, p in zip(walked[1:], unsplit[1:]))  # rank 0 defers nothing
    gis = build_schedule("gis", 4, 8, 2)
    gis_stash, gis_held = [stash[0]] * 8, [held[0]] * 8
    assert list_order_peaks(gis, gis_stash, gis_held) == list_order_peaks(gis, gis_stash)


def test_extension_in_m_matches_exact_simulation():
    """Above m = 3p + r the planner simulates two smaller m and extends linearly: the memory it reports
    is never below the exact simulation's and the step time agrees, for every registered schedule."""
    job = Job("gpt3-125m", get_preset("gpt3-125m"), 96)
    planner = Planner(job, Cluster(4, A100_80GB))
    checked = 0
    for entry in registered_schedules():
        for pp, dp, b in ((2, 2, 1), (4, 1, 2)):
            v = entry.chunks_per_rank or ((2 if pp == 2 else 3) if entry.supports_virtual else 1)
            if job.config.num_layers % (pp * v):  # the V shapes' 2 chunks: 12 layers do not split into 8 stages
                continue
            c = Configuration(1, pp, dp, b, "none", entry.name, v, tuple(_options(entry, v).items()), dp > 1)
            extended, exact = planner.evaluate(c), planner.evaluate(c, exact=True)
            assert extended.extrapolated and not exact.extrapolated
            for got, want in zip(extended.memory_bytes, exact.memory_bytes):
                assert got >= want * (1 - 1e-9), (entry.name, pp)
            assert extended.step_s == pytest.approx(exact.step_s, rel=0.01), (entry.name, pp)
            checked += 1
    assert checked >= 14


# Never over budget ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,gpus,batch,memory_gib", [
    ("gpt3-350m", 8, 32, 4.0), ("gpt3-350m", 8, 32, 8.0), ("llama2-7b", 8, 16, 40.0), ("llama2-7b", 4, 16, 80.0),
])
def test_never_proposes_a_configuration_over_the_memory_budget(preset, gpus, batch, memory_gib):
    """Property over a grid of jobs and budgets: every ranked configuration's modelled memory is within the
    budget, and re-evaluating it from scratch (new planner, m simulated exactly) agrees."""
    hardware = dataclasses.replace(A100_80GB, memory_gib=memory_gib)
    job = Job(preset, get_preset(preset), batch)
    plan = Planner(job, Cluster(gpus, hardware), max_micro_batch_size=2, max_virtual_stages=4).plan(top=10)
    capacity = Cluster(gpus, hardware).capacity_bytes
    fresh = Planner(job, Cluster(gpus, hardware))
    for p in plan.ranked:
        assert p.fits and p.peak_memory_bytes <= capacity, p.configuration.label()
        again = fresh.evaluate(p.configuration, exact=True)
        assert again.peak_memory_bytes <= capacity and again.step_s is not None, p.configuration.label()
        # Memory is the sum of its parts, state from the closed forms of planning.memory (the backward's
        # working set per rank: memory.backward_transient_bytes).
        assert p.memory_bytes == pytest.approx([s + a + p.transient_bytes + w
                                                for s, a, w in zip(p.state_bytes, p.stash_bytes, p.backward_bytes)])
    assert plan.over_memory > 0  # the budgets are tight enough to discard something
    steps = [p.step_s for p in plan.ranked]
    assert steps == sorted(steps) or all(abs(a - b) <= 1e-3 * a for a, b in zip(steps, sorted(steps)))


def test_weights_alone_over_budget_fits_nothing():
    plan = Planner(Job("llama2-70b", get_preset("llama2-70b"), 8), Cluster(8, A100_80GB)).plan(top=3)
    assert plan.ranked == [] and plan.over_memory == plan.considered


# Against the executor ------------------------------------------------------------------------------------


def _measure(ctx, flags, tp, pp):
    """Worker: train three iterations with the planner's flags; peak stash bytes per pipeline rank."""
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(flags + ["--mock-data", "--train-iters", "3", "--log-interval", "1000"])
    rows = pretrain(args, ctx.parallel_state(tp, pp))
    return [max(r["peak_stash_bytes"][k] for r in rows) for k in range(pp)] if rows else None


EXECUTOR_CASES = [  # (preset, attention backend, global batch, configuration); 2bw runs its steady state
    ("gpt-tiny", "reference", 8, Configuration(1, 2, 1, 2, "none", "1f1b")),
    ("gpt-tiny", "reference", 8, Configuration(1, 2, 1, 2, "none", "interleaved-1f1b", 2)),
    ("llama-tiny", "sdpa", 4, Configuration(1, 2, 1, 2, "full", "gpipe")),
    ("gpt-tiny", "reference", 8, Configuration(1, 2, 1, 2, "selective", "po-h", 2)),
    ("llama-tiny", "reference", 8, Configuration(1, 2, 1, 2, "none", "2bw")),
    ("gpt-tiny", "reference", 8, Configuration(1, 2, 1, 1, "none", "looped-bfs", 2)),
    ("llama-tiny", "reference", 8, Configuration(1, 4, 1, 1, "none", "bpipe")),
    ("gpt-tiny", "reference", 8, Configuration(1, 4, 1, 1, "none", "1f1b", 1, (("offload_chunks", 1),))),
    # Deferred BW: the output gradients held from BI to BW (an untied head's logits gradient on LLaMA), and
    # under full recompute the layer inputs BI rebuilt as well.
    ("llama-tiny", "reference", 8, Configuration(1, 2, 1, 1, "none", "zb-v", 2)),
    ("gpt-tiny", "reference", 8, Configuration(1, 4, 1, 1, "full", "zb-h1")),
]


@pytest.mark.parametrize("preset,backend,batch,configuration", EXECUTOR_CASES,
                         ids=[c.label().split(" tp")[0].replace(" ", "-") for *_, c in EXECUTOR_CASES])
def test_memory_model_matches_the_executors_measured_peaks(preset, backend, batch, configuration):
    """A real CPU run on a gloo world, launched with the planner's own flags: the peak stash bytes the
    executor's activation store measured on every pipeline rank are within 5% of the planner's."""
    job = Job(preset, get_preset(preset), batch, attention_backend=backend, device_type="cpu")
    c = configuration
    prediction = Planner(job, Cluster(c.tp * c.pp * c.dp, CPU)).evaluate(c)
    measured = run_distributed(c.tp * c.pp * c.dp, _measure, launch_flags(job, prediction.configuration), c.tp, c.pp)[0]
    # A rank hosting BPipe's parked stashes receives them when its peer's transfers land, not at an action of
    # its own: the planner charges it a bound that holds whatever the timing (`resident_peaks`).
    m = batch // (c.dp * c.micro_batch_size)
    hosts = {a for _, a in parking_pairs(build_schedule(c.schedule, c.pp, m))} if c.schedule == "bpipe" else set()
    for rank, (predicted, got) in enumerate(zip(prediction.stash_bytes, measured)):
        if rank in hosts:
            assert got <= (1 + MEMORY_TOLERANCE) * predicted, (rank, predicted, got)
        else:
            assert abs(predicted - got) <= MEMORY_TOLERANCE * got, (rank, predicted, got)


# Launch flags --------------------------------------------------------------------------------------------


def _validate_flags(flags, world_size, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = build_parser().parse_args(flags + ["--mock-data", "--train-iters", "1"])
    return validate_args(args, this_machine=False)  # a plan is for its cluster, not for this CPU machine


@pytest.mark.parametrize("preset,gpus,batch", [("gpt3-1.3b", 16, 64), ("llama2-7b", 8, 32)])
def test_ranked_rows_carry_flags_the_training_parser_accepts(preset, gpus, batch, monkeypatch):
    job = Job(preset, dataclasses.replace(get_preset(preset), seq_length=1024, max_position_embeddings=1024), batch)
    cluster = Cluster(gpus, A100_80GB)
    planner = Planner(job, cluster, max_micro_batch_size=2, max_virtual_stages=2)
    plan = planner.plan(top=6)
    rows = list(plan.ranked)
    # One configuration of every registered schedule as well, so every option's flag is exercised.
    for entry in registered_schedules():
        v = 2 if entry.supports_virtual else 1
        zero = gpus > 8 and entry.name != "2bw"  # 2BW refuses the distributed optimizer (validate_args)
        c = Configuration(2, 4, gpus // 8, 1, "none", entry.name, v, tuple(_options(entry, v).items()), zero)
        rows.append(planner.evaluate(c))
    for p in rows:
        flags = launch_flags(job, p.configuration)
        assert _validate_flags(flags, gpus, monkeypatch) == [], (p.configuration.label(), flags)
        script = "pretrain_llama.py" if preset.startswith("llama") else "pretrain_gpt.py"
        assert script in launch_command(job, cluster, p.configuration)
    assert "--seq-length 1024" in " ".join(launch_flags(job, rows[0].configuration))


def test_the_planner_returns_only_configurations_the_training_script_accepts():
    """The library checks what it returns with pretrain_gpt.py's own validate_args: 2BW with ZeRO-1 is in
    the search, refused with the script's reason, and replaced by its plain-data-parallel twin."""
    job = Job("gpt3-350m", get_preset("gpt3-350m"), 16)
    planner = Planner(job, Cluster(8, A100_80GB), schedules=["1f1b", "2bw"], max_micro_batch_size=1)
    assert any(c.schedule == "2bw" and c.distributed_optimizer for c in planner.configurations())
    plan = planner.plan()
    assert not any(p.configuration.schedule == "2bw" and p.configuration.distributed_optimizer for p in plan.ranked)
    assert any(p.configuration.schedule == "2bw" and p.configuration.dp > 1 for p in plan.ranked)
    assert any(p.configuration.distributed_optimizer for p in plan.ranked)  # 1F1B keeps ZeRO-1
    reasons = [r for r in plan.skipped if "pretrain_gpt.py refuses its flags" in r]
    assert reasons and all("2bw" in r and "--use-distributed-optimizer is not supported" in r for r in reasons)
    for p in plan.ranked:
        assert planner.refusal(p.configuration) is None


def test_a_refused_configuration_rules_out_nothing(monkeypatch):
    """A configuration the script refuses does not rule out the same one with more recomputation (parked
    behind it, it comes back): with recompute none refused, the plan is the one searched without it."""
    from megatron_pp.training import arguments

    original = arguments.validate_args

    def refusing_no_recompute(args, world_size=None, **kwargs):
        errors = original(args, world_size, **kwargs)
        return errors + (["no --recompute-granularity: refused for this test"]
                         if args.recompute_granularity is None else [])

    job = Job("gpt3-350m", get_preset("gpt3-350m"), 64)
    cluster = Cluster(8, dataclasses.replace(A100_80GB, memory_gib=8))
    without = Planner(job, cluster, schedules=["1f1b"], max_micro_batch_size=1, recompute_options=("selective", "full"))
    expected = [p.configuration for p in without.plan(top=3).ranked]
    monkeypatch.setattr(arguments, "validate_args", refusing_no_recompute)
    plan = Planner(job, cluster, schedules=["1f1b"], max_micro_batch_size=1).plan(top=3)
    assert [p.configuration for p in plan.ranked] == expected
    assert any("refused for this test" in reason for reason in plan.skipped)


# Plugins -------------------------------------------------------------------------------------------------


def _toy_gpipe(num_ranks, num_microbatches):
    return dataclasses.replace(gpipe(num_ranks, num_microbatches), name="toy-gpipe")


def _toy_versioned(num_ranks, num_microbatches):
    """1F1B whose second half of microbatches runs on weight version 1: two versions live at once."""
    base = one_f_one_b(num_ranks, num_microbatches)
    version = lambda mb: int(2 * mb >= num_microbatches)  # noqa: E731
    actions = [[Action(a.op, a.microbatch, a.chunk, version=version(a.microbatch)) for a in acts]
               for acts in base.actions]
    return Schedule("toy-versioned", num_ranks, num_microbatches, 1, looped_placement(num_ranks, 1), actions)


def _toy_broken(num_ranks, num_microbatches):
    raise RuntimeError("this plugin is broken")


def test_a_schedule_registered_by_a_plugin_is_planned(monkeypatch):
    """Toy schedules registered from outside the package are searched, memory-modelled from their own
    lists (GPipe's m stashes; a second weight version), ranked and launchable; a broken one is skipped."""
    toys = {"toy-gpipe": _toy_gpipe, "toy-versioned": _toy_versioned, "toy-broken": _toy_broken}
    for name, builder in toys.items():
        register_schedule(name, builder, supports_virtual=False, description="test plugin")
    try:
        job = Job("gpt3-350m", get_preset("gpt3-350m"), 32)
        cluster = Cluster(8, A100_80GB)
        planner = Planner(job, cluster, schedules=[*toys, "no-such-schedule"], max_micro_batch_size=2)
        plan = planner.plan()
        assert {"toy-gpipe", "toy-versioned"} <= {p.configuration.schedule for p in plan.ranked}
        assert any(p.weight_versions == 2 for p in plan.ranked if p.configuration.schedule == "toy-versioned")
        assert any("toy-broken" in reason and "this plugin is broken" in reason for reason in plan.skipped)
        assert any("no-such-schedule" in reason for reason in plan.skipped)
        for p in plan.ranked:
            c = p.configuration
            if c.schedule == "toy-gpipe":
                assert p.peak_stashes == (p.num_microbatches,) * c.pp
                assert p.weight_versions == 1
            else:  # two versions are alive at once only when a rank has several microbatches in flight
                assert p.weight_versions == live_weight_versions(_toy_versioned(c.pp, p.num_microbatches))
                per_param = state_bytes_per_parameter(dp=c.dp, distributed_optimizer=c.distributed_optimizer)
                params = planner.rank_parameters(c, build_schedule(c.schedule, c.pp, p.num_microbatches))
                # Per extra version: a bf16 copy of the weights and the fp32 gradient its deferred update holds.
                extra = (2 + 4) * (p.weight_versions - 1)
                assert p.state_bytes == pytest.approx([n * (per_param + extra) for n in params])
            assert _validate_flags(launch_flags(job, c), 8, monkeypatch) == []
    finally:
        for name in toys:
            unregister_schedule(name)


def test_live_weight_versions():
    assert live_weight_versions(build_schedule("1f1b", 4, 8)) == 1
    assert live_weight_versions(_toy_versioned(4, 8)) == 2


# The command line ----------------------------------------------------------------------------------------


def test_cli_ranks_and_prints_launch_commands(capsys, tmp_path):
    out = tmp_path / "plan.json"
    argv = ["--model-preset", "gpt3-350m", "--global-batch-size", "16", "--num-gpus", "4", "--gpu-memory-gb", "24",
            "--max-micro-batch-size", "2", "--top", "3", "--commands", "2", "--json", str(out)]
    assert plan_tool.main(argv) == 0
    text = capsys.readouterr().out
    assert "step s" in text and text.count("bash launch/local.sh pretrain_gpt.py") == 2
    # Absolute figures rest on a published achieved matmul efficiency, printed with its source.
    assert "matmul efficiency 0.705 assumed: PipeOffload (arXiv 2503.01328" in text
    assert out.exists()


@pytest.mark.parametrize("argv", [
    ["--model-preset", "nope", "--global-batch-size", "8", "--num-gpus", "8"],
    ["--model-preset", "gpt3-125m", "--global-batch-size", "0", "--num-gpus", "8"],
    ["--model-preset", "gpt3-125m", "--global-batch-size", "8", "--num-gpus", "eight"],
    ["--model-preset", "gpt3-125m", "--global-batch-size", "8", "--num-gpus", "8", "--recompute-options", "most"],
    ["--model-preset", "gpt3-125m", "--global-batch-size", "8", "--num-gpus", "8", "--efficiency-file", "/no/such.json"],
    ["--model-preset", "gpt3-125m", "--global-batch-size", "8", "--num-gpus", "8", "--hardware", "tpu"],
    ["--global-batch-size", "8", "--num-gpus", "8"],
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, capsys):
    try:
        code = plan_tool.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


def test_tensor_parallel_collectives_take_the_numerics_bytes_and_a_latency():
    """A layer's tp collectives: two all-reduces of s·b·h activations in the job's dtype, each with the
    hardware's fixed per-collective cost (tools/validate_planner.py measures it on gloo)."""
    import dataclasses

    from megatron_pp.planning.efficiency import LayerShape, tp_communication_s

    config = get_preset("gpt-tiny")
    bf16 = LayerShape.from_config(config, 2)
    fp32 = LayerShape.from_config(config, 2, activation_bytes=4)
    ring = 2 * (2 - 1) / 2 * config.seq_length * 3 * config.hidden_size / (CPU.tp_link_gbps * 1e9)
    assert tp_communication_s(bf16, 3, CPU) == pytest.approx(2 * 2 * ring)
    assert tp_communication_s(fp32, 3, CPU) == pytest.approx(2 * 4 * ring)
    slow = dataclasses.replace(CPU, collective_latency_s=1e-3)
    assert tp_communication_s(fp32, 3, slow) == pytest.approx(2 * (1e-3 + 4 * ring))
    assert tp_communication_s(LayerShape.from_config(config, 1), 3, slow) == 0.0
    assert fp32.compute_key() == bf16.compute_key()  # one measured layer curve serves both


def test_cli_prints_only_rows_the_training_script_accepts(capsys, monkeypatch):
    """Every row the tool prints passed pretrain_gpt.py's own validate_args inside the planner: a
    configuration the script would refuse is not printed, and the header gives the script's reason."""
    from megatron_pp.training import arguments

    original = arguments.validate_args

    def refusing_tp2(args, world_size=None, **kwargs):
        errors = original(args, world_size, **kwargs)
        return errors + (["--tensor-model-parallel-size 2: refused for this test"]
                         if args.tensor_model_parallel_size == 2 else [])

    monkeypatch.setattr(arguments, "validate_args", refusing_tp2)
    argv = ["--model-preset", "gpt3-350m", "--global-batch-size", "16", "--num-gpus", "4", "--gpu-memory-gb", "24",
            "--max-micro-batch-size", "2", "--top", "40", "--commands", "40", "--schedules", "1f1b"]
    assert plan_tool.main(argv) == 0
    text = capsys.readouterr().out
    assert "pretrain_gpt.py refuses its flags: --tensor-model-parallel-size 2: refused for this test" in text
    assert "--tensor-model-parallel-size 2 " not in text and "--tensor-model-parallel-size 4 " in text
    # Their step time includes the tensor-parallel term, which the CPU validation has not confirmed.
    assert "tp* = step time unvalidated" in text and " 4* " in text


def test_cli_plans_a_schedule_file_and_names_it_in_the_commands(capsys, tmp_path):
    """--pipeline-schedule-file: only layouts the file fits (its pp, m and v), commands that pass the
    training script's check and name the file."""
    from megatron_pp.schedules.registry import unregister_schedule

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from torch_schedule_csv import write_torch_csv

    path = write_torch_csv(str(tmp_path / "zbv.csv"), "ZBVZeroBubble", 4, 8)
    argv = ["--model-preset", "gpt3-1.3b", "--global-batch-size", "16", "--num-gpus", "8", "--top", "5",
            "--commands", "5", "--pipeline-schedule-file", path]
    try:
        assert plan_tool.main(argv) == 0
        text = capsys.readouterr().out
        commands = [line for line in text.splitlines() if line.startswith("#")]
        assert commands and all(f"--pipeline-schedule-file {path}" in c and "--pipeline-model-parallel-size 4" in c
                                and "--pipeline-schedule " not in c for c in commands)
        assert "refuses its flags" not in text
        assert plan_tool.main(argv + ["--schedules", "1f1b"]) == 2
        assert "not both" in capsys.readouterr().err
    finally:
        unregister_schedule("file:zbv.csv")


def test_json_rows_claim_no_validated_step_time_until_a_run_shows_one(tmp_path):
    """The recorded validation (docs/planner.md) missed by −40% to +211% at tp = 1, so a tp = 1 row must not say
    its step time is validated; once `STEP_TIME_VALIDATED` is set, tp = 1 rows say so and tp > 1 rows still
    follow `TENSOR_PARALLEL_VALIDATED`."""
    from megatron_pp.planning import report

    out = tmp_path / "plan.json"
    argv = ["--model-preset", "gpt3-350m", "--global-batch-size", "16", "--num-gpus", "4", "--gpu-memory-gb", "24",
            "--max-micro-batch-size", "2", "--top", "40", "--commands", "0", "--schedules", "1f1b", "--json", str(out)]
    assert plan_tool.main(argv) == 0
    rows = json.loads(out.read_text())["ranked"]
    assert {row["tp"] for row in rows} >= {1, 4}
    assert not any(row["step_time_validated"] for row in rows)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "STEP_TIME_VALIDATED", True)
        assert plan_tool.main(argv) == 0
    rows = json.loads(out.read_text())["ranked"]
    assert all(row["step_time_validated"] == (row["tp"] == 1) for row in rows)
