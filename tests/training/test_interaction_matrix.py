"""The interaction matrix (megatron_pp/testing/interaction.py, docs/reliability.md "The interaction matrix"): a
pairwise covering array over precision, schedule (registry, file, plugin), layout, virtual stages, sequence
parallelism, recompute, offload, distributed optimizer, embeddings, attention and model, each case two steps of
the real `pretrain` on tests/dist.py's pool (world <= 4). A case the start-up path refuses must be refused in one
line naming a flag it gave (tools/schedule_matrix.py lists them in docs/schedules.md); a case that runs must be
finite, move every parameter in each applied step and equal its reference: in fp32 one process from the same
weights at each step (loss, gradient norm and every gradient tensor within 1e-5) and AdamW's update of the run's
own gradients (every element), the same precision's 1F1B run in bf16 / fp16 (tests/interaction.py's tolerance),
with each bf16 / fp16 step's weights AdamW's update of the run's own gradients rounded to the model's dtype.

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


def test_the_fp32_check_holds_each_step_and_update_to_its_reference():
    """exact_compare on a run made of the reference's own numbers passes, and fails on each fault it is there for:
    an update without weight decay (1e-4 of a weight), one step-2 gradient tensor 1e-4 off, a run that does not
    start from the seed's model. One process, no pool: the checker itself."""
    import torch

    from tests.interaction import adamw_steps, exact_compare, reference_step

    case = {**SPLIT_BACKWARD_CASES[0], "precision": "fp32", "schedule": "1f1b"}
    job = interaction.make_job(case, "unused")
    lr, wd = interaction.LR, interaction.WEIGHT_DECAY
    step1 = reference_step(job.argv, 0)
    w0 = step1[3]
    w1 = adamw_steps(job.argv, w0, [step1[2]], [step1[1]], [lr])[0]
    step2 = reference_step(job.argv, 1, w1)
    w2 = adamw_steps(job.argv, w0, [step1[2], step2[2]], [step1[1], step2[1]], [lr, lr])[1]

    def run(weights=(w0, w1, w2), grads=(step1[2], step2[2])):
        rows = [(step1[0], step1[1], False, lr), (step2[0], step2[1], False, lr)]
        exact_compare(job, [step1, step2])([{"rows": rows, "grads": list(grads), "weights": list(weights)}])

    run()
    no_decay = {n: w + lr * wd * w0[n] if w.dim() > 1 else w for n, w in w1.items()}
    with pytest.raises(AssertionError, match="step 1's update of"):
        run(weights=(w0, no_decay, w2))
    name = next(iter(step2[2]))
    with pytest.raises(AssertionError, match=f"step 2: gradient of {name}"):
        run(grads=(step1[2], {**step2[2], name: step2[2][name] * (1 + 1e-4)}))
    other_start = {**w0, name: w0[name] + torch.finfo(torch.float32).eps * w0[name].abs().max()}
    with pytest.raises(AssertionError, match="does not start from the seed's model"):
        run(weights=(other_start, w1, w2))
