"""Evaluation reads the validation split as Megatron-LM does: one block of eval_iters global batches after
another (evaluation k at iteration k·eval_interval reads block k − 1; the closing one block
train_iters // eval_interval), so each evaluation sees new samples and a resumed run reads the same blocks."""
from __future__ import annotations

from megatron_pp.training import step_data


def test_each_evaluation_reads_the_next_block(monkeypatch):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    firsts = []
    original = step_data.TrainingData.microbatches

    def recording(self, split, first_sample, dp_rank, device, *rest):
        if split is self.valid:
            firsts.append(first_sample)
        return original(self, split, first_sample, dp_rank, device, *rest)

    monkeypatch.setattr(step_data.TrainingData, "microbatches", recording)
    pretrain(parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2",
                         "--global-batch-size", "4", "--train-iters", "5", "--eval-interval", "2",
                         "--eval-iters", "2", "--seed", "7"]))
    # Evaluations at iterations 2 and 4 and at the end (5): blocks 0, 1 and 5 // 2 = 2, two batches of 4 each.
    assert firsts == [0, 4, 8, 12, 16, 20]
