"""megatron_pp/testing/interaction.py: the interaction matrix's covering array covers every pair of levels of every
two factors that a case can hold, is the same for the same seed, keeps only cases that exist by construction, and
(with the start-up path as oracle) runs a case for every pair but those the code always refuses."""
from __future__ import annotations

import itertools

import pytest

from megatron_pp.testing import interaction


@pytest.fixture(scope="module")
def array():
    return interaction.covering_array()


def _pairs_of(rows, table):
    return {(f, row[f], g, row[g]) for row in rows for f, g in itertools.combinations(list(table), 2)}


def test_every_pair_of_levels_of_every_two_factors_appears(array):
    """The proof of coverage, independent of how the array was built: every pair of levels of every two factors is
    in some case, or the constraints rule that pair out by itself (a pair that they rule out only with a third
    factor would fail here, not be skipped)."""
    table = interaction.factors()
    seen = _pairs_of(array, table)
    skipped = []
    for f, g in itertools.combinations(list(table), 2):
        for a, b in itertools.product(table[f], table[g]):
            if (f, a, g, b) not in seen:
                reason = interaction.infeasible({f: a, g: b})
                assert reason is not None, f"{f}={a} with {g}={b} can be a case but is in none"
                skipped.append((f, a, g, b, reason))
    assert len(skipped) == interaction.skipped_pairs() == 26, skipped
    # docs/reliability.md quotes these: 26 of the 679 pairs of levels skipped, 66 cases before the repair pass
    assert len(interaction.feasible_pairs()) + len(skipped) == 679 and len(array) == 66
    assert {s[4] for s in skipped} == {
        "schedule has no virtual stages", "schedule runs exactly 2 chunks per rank",
        "schedule takes no offload option", "sequence parallelism splits along tensor-parallel ranks",
        "llama-tiny's embeddings are untied and no flag ties them"}
    for row in array:
        assert interaction.infeasible(row) is None, row


def test_the_levels_are_the_registry_a_file_and_a_plugin():
    from megatron_pp.schedules.registry import registered_schedules

    builtin = {e.name for e in registered_schedules() if e.builder.__module__.startswith("megatron_pp.")}
    assert set(interaction.factors()["schedule"]) == builtin | {"file", "plugin"}
    assert {"zb-h1", "zb-h2", "zb-v", "v-half", "gis", "2bw", "bpipe", "looped-bfs"} <= builtin


def test_same_seed_same_array_and_size_fits_the_suite(array):
    assert interaction.covering_array() == array
    assert interaction.covering_array(seed=8) != array
    # precision x schedule alone needs 3 x 16 = 48 cases; the greedy array stays within 40% of that bound
    assert 48 <= len(array) <= 67


def test_feasible_exactly_when_no_pair_is_ruled_out():
    """What the generator's pair table assumes: every constraint reads at most two factors. Checked on a sample
    of whole cases (drawn, fixed seed) against `infeasible` on the whole case."""
    import random

    table = interaction.factors()
    names, levels = list(table), list(table.values())
    rng = random.Random(0)
    for _ in range(3000):
        case = {n: rng.choice(lv) for n, lv in zip(names, levels)}
        by_pairs = any(interaction.infeasible({f: case[f], g: case[g]}) for f, g in itertools.combinations(names, 2))
        assert (interaction.infeasible(case) is not None) == by_pairs, case


def test_with_the_start_up_path_every_pair_runs_somewhere_but_what_the_code_always_refuses(tmp_path):
    """The array the matrix test runs: a pair held only by refused cases gets a case that runs, except 2BW with the
    distributed optimizer (refused whatever else the case holds). bf16 and fp16 run with every split-backward
    schedule and every other schedule level."""
    accepts = interaction.accepted(str(tmp_path))
    rows = interaction.covering_array(accepts=accepts)
    table = interaction.factors()
    running = [row for row in rows if accepts(row)]
    refused_only = _pairs_of(rows, table) - _pairs_of(running, table)
    assert refused_only == {("schedule", "2bw", "distributed_optimizer", True)}
    for precision, schedule in itertools.product(("bf16", "fp16"), table["schedule"]):
        assert any(r["precision"] == precision and r["schedule"] == schedule for r in running), (precision, schedule)


def test_a_case_is_its_command_line(tmp_path):
    case = {"precision": "fp16", "schedule": "file", "layout": (2, 2, 1), "virtual": 2, "sequence_parallel": True,
            "recompute": "full", "offload": "fraction", "distributed_optimizer": True, "embeddings": "untied",
            "attention": "gqa", "model": "gpt-tiny"}
    job = interaction.make_job(case, str(tmp_path))
    argv = " ".join(job.argv)
    assert job.world == 4
    for part in ("--fp16 --initial-loss-scale 4096", "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
                 "--sequence-parallel", "--recompute-granularity full --recompute-method uniform",
                 "--offload-fraction 0.5", "--use-distributed-optimizer", "--untie-embeddings-and-output-weights",
                 "--group-query-attention --num-query-groups 2", "--num-layers 4", "--global-batch-size 3"):
        assert part in argv, part
    file = job.argv[job.argv.index("--pipeline-schedule-file") + 1]
    assert file.startswith(str(tmp_path)) and "--pipeline-schedule " not in argv
    plugin = interaction.make_job({**case, "schedule": "plugin"}, str(tmp_path)).argv
    assert plugin[plugin.index("--schedule-plugin") + 1] == interaction.PLUGIN
    assert interaction.refusal(job.argv, job.world) is None
