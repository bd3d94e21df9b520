"""Tensor parallelism: layers split across a TP process group, the autograd mappings between split and
replicated activations, vocabulary-parallel cross-entropy, and TP-aware random-number streams.

Activations are sequence-first `[s, b, h]`. Every layer and function takes `tp_group`; `None` (or a
size-1 group) means a single rank and no communication, which is how the reference model is built.
"""
from megatron_pp.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_pp.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    gather_tensor,
    mark_partitioned,
    mark_replicated,
    param_is_partitioned,
    param_is_replicated_in_tp,
    shard_tensor,
)
from megatron_pp.core.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from megatron_pp.core.tensor_parallel.random import (
    TENSOR_PARALLEL_RNG,
    RNGState,
    RNGTracker,
    get_default_rng_state,
    get_rng_tracker,
    model_parallel_seed,
    set_default_rng_state,
)
from megatron_pp.core.tensor_parallel.utils import divide, tp_rank, tp_size

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "RNGState",
    "RNGTracker",
    "TENSOR_PARALLEL_RNG",
    "column_parallel_linear",
    "copy_to_tp_region",
    "divide",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "gather_tensor",
    "get_default_rng_state",
    "get_rng_tracker",
    "mark_partitioned",
    "mark_replicated",
    "model_parallel_seed",
    "param_is_partitioned",
    "param_is_replicated_in_tp",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "set_default_rng_state",
    "shard_tensor",
    "tp_rank",
    "tp_size",
    "vocab_parallel_cross_entropy",
]
