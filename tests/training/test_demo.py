"""The README's demo, shortened: pretraining on the embedded real-text corpus lowers validation loss."""
import pytest

from megatron_pp.data.demo_corpus import demo_flags, prepare_demo_data
from tests.dist import run_distributed


def _demo_rows(ctx, argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    return pretrain(parse_args(argv, default_preset="gpt-tiny"), state=ctx.parallel_state(1, 2))


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    return prepare_demo_data(str(tmp_path_factory.mktemp("demo-data")))


def test_shortened_demo_lowers_validation_loss(demo_data):
    argv = demo_flags(demo_data) + [
        "--split", "95,5,0", "--seq-length", "64", "--max-position-embeddings", "64", "--num-layers", "4",
        "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "512",
        "--pipeline-model-parallel-size", "2", "--micro-batch-size", "8", "--global-batch-size", "32",
        "--train-iters", "24", "--lr", "2e-3", "--lr-warmup-iters", "4", "--eval-interval", "8", "--eval-iters", "2",
    ]
    rows = run_distributed(2, _demo_rows, argv)[0]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    train = [r["loss"] for r in rows if "loss" in r]
    assert len(evals) == 3 and len(train) == 24
    assert evals[-1] < evals[0] - 0.3, evals  # untrained ≈ ln(4096) ≈ 8.3; it must visibly learn
    assert train[-1] < train[0] - 1.0, (train[0], train[-1])
