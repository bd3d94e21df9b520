"""looped-bfs (modular pipeline, breadth-first) and the layered-reduction pass: lists, errors, validator, simulator."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_pp.schedules import looped
from megatron_pp.schedules.comm import HOIST_TO_SEND_ONLY_BATCHES, insert_communication
from megatron_pp.schedules.generators import one_f_one_b
from megatron_pp.schedules.ir import Action, Op, Schedule, ScheduleError
from megatron_pp.schedules.looped import add_layered_reduction, looped_bfs
from megatron_pp.schedules.registry import build_schedule, get_schedule
from megatron_pp.schedules.simulate import simulate
from megatron_pp.schedules.validate import validate
from megatron_pp.training.arguments import build_parser, validate_args


def _ops(schedule: Schedule, rank: int, ops=(Op.F, Op.B, Op.REDUCE_GRAD)) -> list[str]:
    return [str(a) for a in schedule.actions[rank] if a.op in ops]


def test_docstring_tables_are_the_generated_lists():
    doc = "\n".join(line.strip() for line in looped.__doc__.splitlines())
    assert looped_bfs(4, 8, 2).format_table() in doc
    block = doc[doc.index("rank 0 | F0.0 F1.0 F2.0 F3.0 F0.1"):doc.index("(`tests/schedules/test_looped.py`")]
    assert block.replace("rank 0 |", "").split() == _ops(looped_bfs(4, 8, 2, 4, True), 0)


def test_docstring_simulated_numbers():
    one_group = simulate(build_schedule("looped-bfs", 4, 8, 2))
    assert one_group.makespan == 57 and one_group.busy == [48] * 4 and one_group.peak_stash == [16] * 4
    two_groups = simulate(build_schedule("looped-bfs", 4, 8, 2, breadth_first_microbatches=4,
                                         layered_grad_accumulation=True))
    assert two_groups.makespan == 66 and two_groups.peak_stash == [8] * 4
    assert simulate(build_schedule("1f1b", 4, 8)).bubble_fraction == pytest.approx(3 / 11)


def test_placement_is_stage_k_on_rank_k_mod_p():
    s = build_schedule("modular", 3, 6, 4)  # the alias
    assert s.name == "looped-bfs"
    assert [s.stage_of(k % 3, k // 3) for k in range(12)] == list(range(12))


@pytest.mark.parametrize("p, m, v, group", [(2, 4, 2, None), (3, 6, 3, 3), (4, 8, 2, 4), (4, 12, 1, 4), (2, 6, 4, 2)])
def test_breadth_first_order_per_group(p, m, v, group):
    s = looped_bfs(p, m, v, group)
    b = m if group is None else group
    expected = []
    for start in range(0, m, b):
        members = range(start, start + b)
        expected += [f"F{i}.{c}" for c in range(v) for i in members]
        expected += [f"B{i}.{c}" for c in reversed(range(v)) for i in members]
    for rank in range(p):
        assert _ops(s, rank) == expected
    assert s.options["breadth_first_microbatches"] == b


@pytest.mark.parametrize("p, v", [(2, 1), (2, 2), (3, 4), (4, 1), (4, 2), (4, 4), (4, 8), (8, 2)])
@pytest.mark.parametrize("extra", [0, 1, 4])
def test_simulated_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, v, extra):
    """One breadth-first group: the bubble is the fill and drain only, F = 1, B = 2 per chunk, any m >= p."""
    m = p + extra
    result = simulate(build_schedule("looped-bfs", p, m, v))
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert result.makespan == 3 * (v * m + p - 1)
    assert result.peak_stash == [v * m] * p


@pytest.mark.parametrize("p, m, v, group", [(2, 8, 2, 2), (4, 8, 2, 4), (4, 12, 4, 4), (3, 12, 2, 6)])
def test_groups_bound_memory_and_repeat_the_fill_and_drain(p, m, v, group):
    result = simulate(build_schedule("looped-bfs", p, m, v, breadth_first_microbatches=group,
                                     layered_grad_accumulation=True))
    assert result.peak_stash == [v * group] * p
    assert result.makespan == (m // group) * 3 * (v * group + p - 1)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * group + p - 1), abs=1e-12)


def test_the_ring_posts_its_receives_beside_the_sends():
    """Without the hoisting preference the communication pass makes rank 1 batch two receives; with it,
    rank 0 posts the receive from rank p-1 beside its own sends. Where a batch completes as a unit (NCCL)
    the first consumer would wait for both receives of rank 1's batch; each receive completing on its own
    (the executor on gloo, the simulator), both lists reach the fill-and-drain bound."""
    schedule = looped_bfs(4, 12, 2)
    plain = dataclasses.replace(schedule, options={**schedule.options, HOIST_TO_SEND_ONLY_BATCHES: False})
    preferred, unpreferred = insert_communication(schedule), insert_communication(plain)
    assert preferred.actions != unpreferred.actions
    assert simulate(unpreferred).makespan == simulate(preferred).makespan == 3 * (2 * 12 + 3)


def test_errors_name_the_flag():
    with pytest.raises(ValueError, match=r"at least --pipeline-model-parallel-size 4 microbatches .* got 3 "
                                         r"microbatches per step"):
        build_schedule("looped-bfs", 4, 3, 2)
    with pytest.raises(ValueError, match=r"got --breadth-first-microbatches 2"):
        build_schedule("looped-bfs", 4, 8, 2, breadth_first_microbatches=2)
    with pytest.raises(ValueError, match=r"--breadth-first-microbatches 3 does not divide the 8 microbatches"):
        build_schedule("looped-bfs", 2, 8, 2, breadth_first_microbatches=3)


@pytest.mark.parametrize("extra, needle", [
    (["--num-layers-per-virtual-pipeline-stage", "3"], "--num-layers-per-virtual-pipeline-stage 3 does not divide 4"),
    (["--num-layers", "6", "--num-layers-per-virtual-pipeline-stage", "2"], "does not divide 6 layer slots"),
    (["--pipeline-schedule", "1f1b", "--breadth-first-microbatches", "2"],
     "--breadth-first-microbatches does not apply to --pipeline-schedule 1f1b"),
    (["--data-parallel-sharding-strategy", "optim_grads_params", "--pipeline-schedule", "po-f"],
     "cannot be combined with host offload (--pipeline-schedule po-f)"),
])
def test_layers_that_do_not_divide_and_bad_combinations_are_argument_errors(extra, needle):
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "1", "--pipeline-model-parallel-size", "2",
            "--pipeline-schedule", "looped-bfs", *extra]
    errors = validate_args(build_parser().parse_args(argv))
    assert any(needle in e for e in errors), errors


def test_on_off_flags_are_generated_with_their_negation():
    parser = build_parser()
    args = parser.parse_args(["--layered-grad-accumulation", "--no-checkpoint-layer-inputs",
                              "--breadth-first-microbatches", "4"])
    assert (args.layered_grad_accumulation, args.checkpoint_layer_inputs, args.breadth_first_microbatches) == (
        True, False, 4)
    assert parser.parse_args([]).layered_grad_accumulation is None
    entry = get_schedule("looped-bfs")
    assert entry.options == ("breadth_first_microbatches", "layered_grad_accumulation", "checkpoint_layer_inputs")


def test_config_file_false_turns_an_on_off_option_off(tmp_path):
    from megatron_pp.training.config_files import config_file_arguments

    path = tmp_path / "run.yaml"
    path.write_text("checkpoint-layer-inputs: false\nlayered_grad_accumulation: true\n")
    assert config_file_arguments(build_parser(), str(path)) == ["--no-checkpoint-layer-inputs",
                                                                "--layered-grad-accumulation"]


# The layered-reduction pass and the validator's per-group rule --------------------------------------------------


def test_reductions_follow_each_chunks_last_backward_of_each_group():
    s = build_schedule("looped-bfs", 2, 4, 2, breadth_first_microbatches=2, layered_grad_accumulation=True)
    assert s.options["microbatches_per_reduction"] == 2
    for rank in range(2):
        acts = s.actions[rank]
        reductions = [i for i, a in enumerate(acts) if a.op is Op.REDUCE_GRAD]
        assert [acts[i].chunk for i in reductions] == [1, 0, 1, 0]  # once per chunk per group
        computes = [a for a in acts if a.op is not Op.REDUCE_GRAD and a.is_compute]
        for i in reductions:
            c = acts[i].chunk
            last = max(j for j in range(i) if acts[j].op is Op.B and acts[j].chunk == c)
            between = [a for a in acts[last + 1:i] if a.is_compute]
            assert between == []  # right after the backward (its send may sit in between)
            group = acts[last].microbatch // 2
            assert all(a.microbatch // 2 > group for a in acts[i:] if a.op is Op.B and a.chunk == c)
        assert len(computes) == 16


def test_the_pass_works_on_any_compute_only_schedule():
    s = add_layered_reduction(one_f_one_b(3, 4))
    assert [str(a) for a in s.actions[0][-2:]] == ["B3.0", "REDUCE_GRAD.0"]
    validate(insert_communication(s))
    with pytest.raises(ValueError, match="already reduces gradients"):
        add_layered_reduction(s)


def _single_rank(text: str, m: int, v: int, group: int | None) -> Schedule:
    options = {} if group is None else {"microbatches_per_reduction": group}
    actions = [Action.parse(t) for t in text.split()]
    return Schedule("t", 1, m, v, [(0, c) for c in range(v)], [actions], options)


@pytest.mark.parametrize("text, group, index, reason", [
    # Reduction of group 0 before its last backward (B1.0): that backward is reported.
    ("F0.0 F1.0 F2.0 F3.0 B0.0 REDUCE_GRAD.0 B1.0 B2.0 B3.0 REDUCE_GRAD.0", 2, 6,
     r"B1.0\): gradients of chunk 0 were already reduced at action 5"),
    # The last group is never reduced.
    ("F0.0 F1.0 F2.0 F3.0 B0.0 B1.0 REDUCE_GRAD.0 B2.0 B3.0", 2, 6, r"only 1 of the 2 reductions of chunk 0 "
                                                                     r".* microbatches 2..3 are never reduced"),
    # A third reduction where two groups exist.
    ("F0.0 F1.0 F2.0 F3.0 B0.0 B1.0 REDUCE_GRAD.0 B2.0 B3.0 REDUCE_GRAD.0 REDUCE_GRAD.0", 2, 10,
     r"already reduced at action 9 \(2 per step, one per 2 microbatches\)"),
    # Without the option there is one group: a reduction in the middle is too early.
    ("F0.0 F1.0 B0.0 REDUCE_GRAD.0 B1.0", None, 4, r"already reduced at action 3, before this backward"),
])
def test_validator_checks_one_reduction_per_group_after_its_last_backward(text, group, index, reason):
    m = 4 if group is not None else 2
    with pytest.raises(ScheduleError, match=rf"rank 0, action {index} .*{reason}"):
        validate(_single_rank(text, m, 1, group))


def test_validator_accepts_per_group_reductions():
    validate(_single_rank("F0.0 F1.0 F2.0 F3.0 B0.0 B1.0 REDUCE_GRAD.0 B2.0 B3.0 REDUCE_GRAD.0", 4, 1, 2))
    # A split backward completes the weight gradient at BW: the reduction follows the group's last BW.
    validate(_single_rank("F0.0 F1.0 BI0.0 BI1.0 BW0.0 BW1.0 REDUCE_GRAD.0", 2, 1, None))


def test_text_form_round_trips_with_the_options():
    s = build_schedule("looped-bfs", 2, 4, 2, breadth_first_microbatches=2, layered_grad_accumulation=True)
    again = Schedule.from_text(s.to_text())
    assert again == s and again.options["layered_grad_accumulation"] is True
    validate(again)


# The exposure model ------------------------------------------------------------------------------------------


def test_depth_first_accumulation_order():
    s = looped.depth_first_accumulation(2, 2)
    assert _ops(s, 0) == ["F0.0", "F0.1", "B0.1", "B0.0", "F1.0", "F1.1", "B1.1", "B1.0"]


@pytest.mark.parametrize("r", [1, 4, 8, 16])
def test_layered_leaves_only_the_last_chunks_reduction_exposed(r):
    """p = 1, v = 8, m = 16, F = 1, B = 2: depth-first DDP starts chunk c's reduction 2c before the end and
    leaves max(r, v·r − 2(v−1)); layered starts it 2cm before the end and leaves r (while r <= 2m)."""
    m, v = 16, 8
    depth_first = looped.exposed_reduction(add_layered_reduction(looped.depth_first_accumulation(m, v)), r)
    layered = looped.exposed_reduction(build_schedule("looped-bfs", 1, m, v, layered_grad_accumulation=True), r)
    assert depth_first == [max(r, v * r - 2 * (v - 1))]
    assert layered == [r]


@pytest.mark.parametrize("r", [1, 4, 8])
def test_exposure_per_stage_and_from_the_last_backwards_start(r):
    """A mapping of per-stage times equals the single number; `from_backward_start` (bucketed overlap inside
    the last backward) starts chunk c's reduction one backward (2) earlier: v·(r − 2) is left, none while
    r <= 2."""
    m, v = 16, 8
    schedule = add_layered_reduction(looped.depth_first_accumulation(m, v))
    assert looped.exposed_reduction(schedule, {stage: r for stage in range(v)}) == looped.exposed_reduction(schedule, r)
    assert looped.exposed_reduction(schedule, r, from_backward_start=True) == [max(0, v * (r - 2))]
    uneven = {stage: (3 * r if stage == 0 else r) for stage in range(v)}  # chunk 0 reduces last
    assert looped.exposed_reduction(schedule, uneven) == [max(3 * r, v * r + 2 * r - 2 * (v - 1))]


def test_sharding_strategy_implies_the_distributed_optimizer():
    from megatron_pp.training.arguments import derive_args
    from megatron_pp.training.optimizer import OptimizerConfig

    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "1", "--pipeline-schedule", "looped-bfs",
            "--data-parallel-sharding-strategy", "optim_grads_params", "--layered-grad-accumulation"]
    args = derive_args(build_parser().parse_args(argv), world_size=2)
    config = OptimizerConfig.from_args(args)
    assert (config.use_distributed_optimizer, config.data_parallel_sharding_strategy,
            config.layered_grad_accumulation) == (True, "optim_grads_params", True)
    assert not derive_args(build_parser().parse_args(argv[:7]), world_size=2).use_distributed_optimizer
