"""What each step reads: the splits, the microbatches of a global batch, and building both from the flags.

Data positions are *sample indices*: the global batch of an iteration covers samples [consumed,
consumed + B), and microbatch j of data-parallel replica d holds consumed + j·b·dp + d·b + [0, b)
(Megatron's layout). A checkpoint stores `consumed`, so a resumed run reads exactly the samples the
uninterrupted run would have read.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from megatron_pp.core import comm
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.data.mock import mock_sample
from megatron_pp.models.config import TransformerConfig
from megatron_pp.training.arguments import model_config_from_args, uses_file_data

# Mock validation samples start here: a range no training run reaches (10^12 samples).
MOCK_VALID_FIRST_SAMPLE = 1 << 40


class Split(Protocol):
    """A dataset split: batches by global sample index (what `megatron_pp.data.builder` returns)."""

    def get_batch(self, sample_indices: Sequence[int], device: torch.device | str = "cpu") -> dict: ...


@dataclass(frozen=True)
class MockSplit:
    """`--mock-data` as a split: sample i is mock sample `first_sample + i` (see `data.mock`)."""

    seed: int
    seq_length: int
    vocab_size: int
    first_sample: int = 0

    def get_batch(self, sample_indices: Sequence[int], device: torch.device | str = "cpu") -> dict:
        samples = torch.stack([mock_sample(self.seed, self.first_sample + i, self.seq_length, self.vocab_size)
                               for i in sample_indices])
        b, s = samples.shape[0], self.seq_length
        return {
            "tokens": samples[:, :-1].contiguous().to(device),
            "labels": samples[:, 1:].contiguous().to(device),
            "loss_mask": torch.ones(b, s, dtype=torch.float32, device=device),
            "position_ids": torch.arange(s, device=device).unsqueeze(0).expand(b, s).contiguous(),
        }


@dataclass
class TrainingData:
    """The train and validation splits and the batch geometry that cuts them into microbatches."""

    train: Split
    valid: Optional[Split]
    micro_batch_size: int
    global_batch_size: int
    dp_size: int
    vocab_size: Optional[int] = None
    """With file datasets, the tokenizer's vocabulary: a batch holding a larger id is refused."""

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def microbatches(self, split: Split, first_sample: int, dp_rank: int, device: torch.device,
                     global_batch_size: Optional[int] = None) -> list[dict]:
        """This replica's microbatches of the global batch starting at sample `first_sample` (of
        `global_batch_size` samples, default the run's: a step of the batch-size ramp-up is smaller)."""
        b = self.micro_batch_size
        count = (global_batch_size or self.global_batch_size) // (b * self.dp_size)
        starts = [first_sample + j * b * self.dp_size + dp_rank * b for j in range(count)]
        batches = [split.get_batch(range(start, start + b), device) for start in starts]
        if self.vocab_size is not None:
            for start, batch in zip(starts, batches):
                _check_token_ids(batch, self.vocab_size, start)
        return batches


def _check_token_ids(batch: dict, vocab_size: int, first_sample: int) -> None:
    """An id outside the vocabulary would index past the embedding (or, split over tensor-parallel ranks,
    be masked to a zero vector silently): the dataset was tokenized with another tokenizer."""
    high = int(torch.maximum(batch["tokens"].max(), batch["labels"].max()))
    low = int(torch.minimum(batch["tokens"].min(), batch["labels"].min()))
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise ValueError(f"--data-path: samples {first_sample}.. hold token id {bad}, outside the tokenizer's "
                         f"vocabulary 0..{vocab_size - 1}: the dataset was tokenized with another tokenizer "
                         "(check --tokenizer-type / --vocab-size / --tokenizer-model)")


def evaluation_enabled(args: argparse.Namespace) -> bool:
    return args.eval_interval is not None and args.eval_iters > 0


def build_config_and_data(args: argparse.Namespace, state: ParallelState) -> tuple[TransformerConfig, TrainingData]:
    """The model config and the data. With file datasets the tokenizer decides the vocabulary."""
    geometry = dict(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                    dp_size=state.dp_size)
    if not uses_file_data(args):
        config = model_config_from_args(args)
        train = MockSplit(args.seed, config.seq_length, config.vocab_size)
        valid = MockSplit(args.seed, config.seq_length, config.vocab_size, MOCK_VALID_FIRST_SAMPLE)
        return config, TrainingData(train, valid if evaluation_enabled(args) else None, **geometry)

    from megatron_pp.data.builder import build_datasets, data_config_from_args, split_sample_counts
    from megatron_pp.data.gpt_dataset import DataFlagError
    from megatron_pp.data.tokenizers import build_tokenizer

    seq_length = model_config_from_args(args, vocab_size=1).seq_length
    data_config = data_config_from_args(args, seq_length=seq_length)
    tokenizer = build_tokenizer(**data_config.tokenizer_args())
    config = model_config_from_args(args, vocab_size=tokenizer.vocab_size)
    # Megatron-LM's counts (a test split is not read here, so not built): they decide the epochs, hence the order.
    train_samples, valid_samples, _ = split_sample_counts(
        args.train_samples or args.train_iters * args.global_batch_size, args.global_batch_size,
        args.eval_iters if evaluation_enabled(args) else 0, args.eval_interval, args.train_iters)
    train, valid, _ = build_datasets(
        data_config, (train_samples, valid_samples, 0), tokenizer.eod,
        barrier=comm.barrier if comm.is_distributed() else None, is_builder=state.rank == 0,
    )
    if train is None:
        raise DataFlagError(f"--split {args.split} leaves no training data")
    if evaluation_enabled(args) and valid is None:
        raise DataFlagError(f"--eval-interval: --split {args.split} leaves no validation data")
    return config, TrainingData(train, valid, vocab_size=config.vocab_size, **geometry)
