"""Mock pretraining data: no files, every sample a deterministic function of (seed, sample index).

Because a sample depends only on its global index, every parallel layout (any tp, pp, dp, schedule)
sees exactly the same tokens for the same global batch, which is what the exactness tests and layout
comparisons rely on. Samples are arithmetic progressions modulo the vocabulary with a random start and
a small random stride, so a model can learn them and the loss visibly falls; they are not text.

Global batch layout (Megatron's): step t covers samples [t·B, (t+1)·B); microbatch j of data-parallel
replica d holds samples t·B + j·b·dp + d·b + [0, b).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

MAX_STRIDE = 7


def _sample_seed(seed: int, index: int) -> int:
    digest = hashlib.blake2b(f"mock:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def mock_sample(seed: int, index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """`seq_length + 1` token ids of global sample `index`."""
    g = torch.Generator().manual_seed(_sample_seed(seed, index))
    start = torch.randint(0, vocab_size, (1,), generator=g)
    stride = torch.randint(1, MAX_STRIDE + 1, (1,), generator=g)
    return (start + stride * torch.arange(seq_length + 1)) % vocab_size


@dataclass(frozen=True)
class MockData:
    seed: int
    seq_length: int
    vocab_size: int
    micro_batch_size: int
    global_batch_size: int
    dp_size: int = 1

    def __post_init__(self) -> None:
        per_step = self.micro_batch_size * self.dp_size
        if self.global_batch_size % per_step != 0:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {self.dp_size}"
            )

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def sample_indices(self, step: int, microbatch: int, dp_rank: int) -> list[int]:
        b = self.micro_batch_size
        first = step * self.global_batch_size + microbatch * b * self.dp_size + dp_rank * b
        return list(range(first, first + b))

    def microbatch(self, step: int, microbatch: int, dp_rank: int, device: torch.device | str = "cpu") -> dict:
        """Batch dict of one microbatch: tokens, labels, loss_mask ([b, s]) and position_ids."""
        samples = torch.stack(
            [mock_sample(self.seed, i, self.seq_length, self.vocab_size) for i in self.sample_indices(step, microbatch, dp_rank)]
        )
        s = self.seq_length
        return {
            "tokens": samples[:, :-1].contiguous().to(device),
            "labels": samples[:, 1:].contiguous().to(device),
            "loss_mask": torch.ones(samples.shape[0], s, dtype=torch.float32, device=device),
            "position_ids": torch.arange(s, device=device).unsqueeze(0).expand(samples.shape[0], s).contiguous(),
        }

    def step_microbatches(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> list[dict]:
        return [self.microbatch(step, j, dp_rank, device) for j in range(self.num_microbatches)]
