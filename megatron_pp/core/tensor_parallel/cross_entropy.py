"""Cross-entropy over logits whose vocabulary dimension is split across the TP group.

The output layer's logits `[s, b, V/tp]` are never gathered: each rank reduces its slice to a few
per-token numbers (max, sum of exponentials, target logit, sum of logits) and two small all-reduces of
`[s, b]`-sized tensors combine them. Everything runs in fp32 whatever the logits' dtype. The forward
keeps exactly one fp32 `[s, b, V/tp]` buffer, which holds the softmax and becomes the gradient in place
in backward, so the loss costs one logits-sized fp32 tensor of activation memory and no more.

Label smoothing follows `torch.nn.functional.cross_entropy`: the target distribution is
`(1 - eps) * onehot(target) + eps / V` over the full vocabulary V, giving

    loss = logsumexp(z) - (1 - eps) * z[target] - eps * mean(z)
    dloss/dz_j = softmax(z)_j - (1 - eps) * [j == target] - eps / V
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_pp.core.tensor_parallel.utils import ProcessGroup, tp_rank, tp_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Optional[ProcessGroup],
                label_smoothing: float) -> torch.Tensor:
        size = tp_size(group)
        vocab_local = logits.size(-1)
        vocab_size = vocab_local * size
        vocab_start = tp_rank(group) * vocab_local

        # The one fp32 working buffer: shifted logits, then exp, then softmax (kept for backward).
        work = logits.to(torch.float32, copy=True)
        # Subtract the max over the *full* vocabulary so exp never overflows on any rank.
        logits_max = work.amax(dim=-1)
        if size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        work.sub_(logits_max.unsqueeze(-1))

        foreign = (target < vocab_start) | (target >= vocab_start + vocab_local)
        local_target = (target - vocab_start).masked_fill_(foreign, 0)
        target_logit = work.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill_(foreign, 0.0)

        # Per-token partial sums, all-reduced together in one collective.
        parts = [target_logit]
        if label_smoothing > 0.0:
            parts.append(work.sum(dim=-1))
        work.exp_()
        parts.append(work.sum(dim=-1))
        sums = torch.stack(parts)
        if size > 1:
            dist.all_reduce(sums, group=group)
        sum_exp = sums[-1]

        loss = sum_exp.log() - sums[0]
        if label_smoothing > 0.0:
            # The target logit is already counted with weight 1; move eps of it onto the mean logit.
            loss = loss + label_smoothing * (sums[0] - sums[1] / vocab_size)
        work.div_(sum_exp.unsqueeze(-1))

        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        ctx.input_dtype = logits.dtype
        ctx.backward_done = False
        ctx.save_for_backward(work, local_target, foreign)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.backward_done:
            raise RuntimeError(
                "vocab_parallel_cross_entropy turns its saved softmax into the gradient in place, so its "
                "backward can run only once; recompute the loss instead of using retain_graph=True"
            )
        ctx.backward_done = True
        grad, local_target, foreign = ctx.saved_tensors
        eps = ctx.label_smoothing
        # softmax - (1 - eps) * onehot(target) - eps / V, built in the softmax buffer.
        onehot_weight = (~foreign).to(grad.dtype).mul_(1.0 - eps)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_weight.unsqueeze(-1))
        if eps > 0.0:
            grad.sub_(eps / ctx.vocab_size)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[ProcessGroup] = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross-entropy of vocabulary-parallel logits.

    `logits`: this rank's `[s, b, V/tp]` slice (rank r holds vocabulary ids `[r * V/tp, (r+1) * V/tp)`),
    any float dtype. `target`: `[s, b]` int64 ids into the full vocabulary, identical on every TP rank.
    Returns the fp32 loss `[s, b]`, equal to `F.cross_entropy(full_logits.flatten(0, 1), target.flatten(),
    reduction="none", label_smoothing=label_smoothing)` reshaped to `[s, b]`. Masking of padding tokens is
    the caller's job (multiply by a loss mask). Backward may run once.
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)} without the vocab dim"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, float(label_smoothing))
