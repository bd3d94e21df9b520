"""The backward's working set the planner adds beside state and stashes (`memory.backward_transient_bytes`, ours):
each candidate of its docstring worked out by hand for gpt-tiny (s 32, h 64, ffn 256, GELU, 4 heads of 64
dims in all, QKV 192, padded vocabulary 512) in bf16, so a term that drifts from the formula the planner's docs
state shows here by name. The dry-run comparisons (tests/planning/test_planner_vs_dry_run.py) hold the whole
within a few percent; they cannot see a term a few bytes or a few kilobytes off."""
import dataclasses

import pytest

from megatron_pp.models.layout import split_layers
from megatron_pp.models.presets import get_preset
from megatron_pp.planning.memory import CPU_FP32, MEGATRON_BF16, backward_transient_bytes

CONFIG = get_preset("gpt-tiny")
S, H, F, QKV, VOCAB, A = 32, 64, 256, 192, 512, 2  # A: bf16 activation bytes
FIRST, LAST = split_layers(CONFIG.num_layers, 2)
MIDDLE = dataclasses.replace(FIRST, has_embedding=False)  # layers only: no head candidate


def _bytes(spec, b, **kw):
    return backward_transient_bytes(CONFIG, spec, b, numerics=MEGATRON_BF16, **kw)


def test_the_shape_is_the_one_worked_out_here():
    assert (CONFIG.seq_length, CONFIG.hidden_size, CONFIG.ffn_size, CONFIG.activation) == (S, H, F, "gelu")
    assert (CONFIG.qkv_size, CONFIG.num_attention_heads * CONFIG.head_dim, CONFIG.padded_vocab_size(1)) == (QKV, H, VOCAB)
    assert (MIDDLE.has_head, LAST.has_head, MIDDLE.num_layers) == (False, True, 2)


def test_fc2_row_parallel_backward_without_sequence_parallelism():
    """b 2: fc2's backward wins (its fp32 weight product 4·h·f is the largest): the residual gradient rows·h,
    fc2's input gradient s·b·f, and the fold: 4·h·f (fp32-output) or 4·s·b·(h + f) (upcast); no gathered
    output gradient without sequence parallelism."""
    tokens = S * 2
    residual = tokens * H * A
    assert _bytes(MIDDLE, 2) == residual + tokens * F * A + 4 * H * F
    assert _bytes(MIDDLE, 2, weight_grad_fold="upcast") == residual + tokens * F * A + 4 * tokens * (H + F)


def test_fc2_row_parallel_backward_with_sequence_parallelism():
    """tp 2 with sequence parallelism: the residual gradient covers s·b/2 rows, fc2 gathers its output
    gradient over the whole sequence (s·b·h) and its input gradient and weight are the rank's f/2 shard."""
    tokens, f = S * 2, F // 2
    expected = (tokens // 2) * H * A + tokens * H * A + tokens * f * A + 4 * H * f
    assert _bytes(MIDDLE, 2, tp=2, sequence_parallel=True) == expected
    # Without it the gathered output gradient is gone and the residual gradient is whole.
    assert _bytes(MIDDLE, 2, tp=2) == tokens * H * A + tokens * f * A + 4 * H * f


def test_fc1_column_parallel_backward_when_nothing_is_freed_before_it():
    """`freed=False` (a stash reloaded from the host): the MLP's saved tensors are not freed before fc1's
    backward, which then wins: its output gradient s·b·f, input gradient s·b·h and fold 4·f·h."""
    tokens = S * 2
    assert _bytes(MIDDLE, 2, freed=False) == tokens * H * A + tokens * F * A + tokens * H * A + 4 * F * H


def test_the_output_layer_wins_on_the_head_stage_at_one_sample():
    """b 1: the output layer's backward (logits gradient s·b·V, input gradient s·b·h, fold 4·V·h), less the
    cross-entropy's fp32 softmax it has freed (4·s·b·V) and the layer a recomputing backward rebuilds (counted
    apart by the planner), beats fc2's; the middle stage has no head and keeps fc2's."""
    tokens = S
    head = tokens * VOCAB * A + tokens * H * A + 4 * VOCAB * H - 4 * tokens * VOCAB
    fc2 = tokens * F * A + 4 * H * F
    assert head > fc2
    assert _bytes(LAST, 1) == tokens * H * A + head
    assert _bytes(LAST, 1, rebuilt=1000) == tokens * H * A + head - 1000
    assert _bytes(MIDDLE, 1) == tokens * H * A + fc2


def test_fp32_models_and_unknown_folds():
    assert backward_transient_bytes(CONFIG, LAST, 2, numerics=CPU_FP32) == 0
    with pytest.raises(ValueError, match="weight-gradient fold 'fp16'"):
        _bytes(MIDDLE, 2, weight_grad_fold="fp16")
