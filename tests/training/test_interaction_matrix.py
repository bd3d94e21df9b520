"""The interaction matrix (megatron_pp/testing/interaction.py, docs/reliability.md "The interaction matrix"): a
pairwise covering array over precision, schedule (registry, file, plugin), layout, virtual stages, sequence
parallelism, recompute, offload, distributed optimizer, embeddings, attention and model, each case two steps of
the real `pretrain` on tests/dist.py's pool (world <= 4). A case the start-up path refuses must be refused in one
line naming a flag it gave (tools/schedule_matrix.py lists them in docs/schedules.md); a case that runs must be
finite, move every parameter in each applied step and equal its reference: in fp32 one process from the same
weights at each step (loss, gradient norm and every gradient tensor within 1e-5) and AdamW's update of the run's
own gradients (every element), the same precision's 1F1B run in bf16 / fp16 (tests/interaction.py's tolerance).

Beside it, bf16 and fp16 with every split-backward schedule at 2 ranks, where issue 37 saw a bf16 zb-h1 run stop
("received 5 gradient contributions in a step declared with 4 microbatches"): the deferred weight gradients must
land once, in the fp32 main gradient.
"""
from __future__ import annotations

import pytest

from megatron_pp.testing import interaction
from tests.dist import run_distributed
from tests.interaction import Runner


def _array() -> list[dict]:
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:
        return interaction.covering_array(accepts=interaction.accepted(workdir))


CASES = _array()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(run_distributed, str(tmp_path_factory.mktemp("interaction")))


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{interaction.case_name(c)}" for i, c in enumerate(CASES)])
def test_interaction_case(runner, case):
    runner.outcome(case)


SPLIT_BACKWARD_CASES = [
    {"precision": precision, "schedule": schedule, "layout": (1, 2, 1), "virtual": 2 if schedule in ("zb-v", "v-half")
     else 1, "sequence_parallel": False, "recompute": "none", "offload": "none", "distributed_optimizer": False,
     "embeddings": "tied", "attention": "mha", "model": "gpt-tiny"}
    for precision in ("bf16", "fp16") for schedule in interaction.SPLIT_BACKWARD
]


@pytest.mark.parametrize("case", SPLIT_BACKWARD_CASES, ids=lambda c: f"{c['precision']}-{c['schedule']}")
def test_split_backward_in_low_precision_equals_1f1b(runner, case):
    assert runner.outcome(case) == "ran"
