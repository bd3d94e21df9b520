"""--use-distributed-optimizer with --grad-reduce-in-bf16: the shards step on fp32 copies of the bf16
reduction buffers, exactly as the replicated optimizer does (tests/training/test_megatron_compat.py checks the
replicated one against fp32 buffers). One process, dp 1: the shard is the whole model."""
from __future__ import annotations

import dataclasses

import torch

from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import build_model
from megatron_pp.training.optimizer import OptimizerConfig, build_optimizer


def _one_step(distributed: bool):
    config = dataclasses.replace(get_preset("llama-tiny"), params_dtype=torch.bfloat16)
    model = build_model(config, seed=6)
    opt = build_optimizer([model], ParallelState.build(),
                          OptimizerConfig(bf16=True, clip_grad=0.5, grad_reduce_in_bf16=True,
                                          use_distributed_optimizer=distributed))
    batches = MockData(6, config.seq_length, config.vocab_size, 2, 4).step_microbatches(0, 0)
    opt.reducer.start_step(len(batches))
    for batch in batches:
        ((model(None, batch).float() * batch["loss_mask"]).sum() / 100).backward()
    opt.reducer.finish()
    outcome = opt.step(1e-3)
    grads = torch.cat([m.grad.flatten() for m in opt.main.params])
    weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    return {b.grad.dtype for b in opt.reducer.buckets}, [m.grad.dtype for m in opt.main.params], grads, outcome, weights


def test_sharded_main_params_step_on_fp32_copies_of_bf16_buffers():
    buffers, dtypes, grads, outcome, weights = _one_step(distributed=True)
    ref_buffers, ref_dtypes, ref_grads, ref_outcome, ref_weights = _one_step(distributed=False)
    assert buffers == ref_buffers == {torch.bfloat16}
    assert set(dtypes) == set(ref_dtypes) == {torch.float32}
    # The same bf16 sums, copied to fp32 the same way (the shards hold the pieces in bucket order, the
    # replicated optimizer in parameter order): equal to the bit as a multiset, and so the step.
    assert torch.equal(grads.sort().values, ref_grads.sort().values) and grads.norm() > 0
    assert outcome.grad_norm == ref_outcome.grad_norm and torch.equal(weights, ref_weights)
