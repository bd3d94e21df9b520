"""Build the model chunks one pipeline rank owns, as placed by its schedule.

The layout (`split_layers`) says which layers each *global* stage holds; the schedule's placement says
which (rank, local chunk) runs each global stage. This module joins the two: local chunk c of pipeline
rank r is `StageModel(layout[schedule.stage_of(r, c)])`, initialised from the seed and global parameter
names, so the weights are identical whatever the layout.

Tied word embeddings (GPT): when the embedding (global stage 0) and the output head (last global
stage) are different stages, each holds its own copy of the weight under the same name, both marked
`shared_embedding=True` by `StageModel`; `finalize_gradients` sums their gradients over the embedding
group (first and last pipeline rank) so they stay equal. When the two stages are chunks of the same
rank, the head's copy is replaced here by the embedding's parameter itself, so there is nothing to sum.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec
from megatron_pp.models.recompute import RecomputeConfig
from megatron_pp.models.transformer import StageModel
from megatron_pp.schedules.ir import Schedule

WORD_EMBEDDING = "embedding.word_embeddings.weight"


def build_model_chunks(
    config: TransformerConfig,
    layout: list[StageSpec],
    schedule: Schedule,
    state: ParallelState,
    *,
    seed: int,
    sequence_parallel: bool = False,
    recompute: Optional[RecomputeConfig] = None,
) -> list[nn.Module]:
    if len(layout) != schedule.num_stages:
        raise ValueError(f"layout has {len(layout)} stages but schedule {schedule.name} has {schedule.num_stages}")
    chunks = []
    for c in range(schedule.num_chunks):
        spec = layout[schedule.stage_of(state.pp_rank, c)]
        chunks.append(
            StageModel(config, spec, tp_group=state.tp_group, sequence_parallel=sequence_parallel,
                       device=state.device, seed=seed, recompute=recompute)
        )
    if not config.untie_embeddings_and_output_weights:
        _tie_embeddings(chunks, schedule, state)
    return chunks


def _tie_embeddings(chunks: list[nn.Module], schedule: Schedule, state: ParallelState) -> None:
    first_rank, first_chunk = schedule.location(0)
    last_rank, last_chunk = schedule.location(schedule.num_stages - 1)
    if (first_rank, first_chunk) == (last_rank, last_chunk):
        return  # one stage holds both: already one parameter
    if first_rank == last_rank:
        if state.pp_rank == first_rank:
            shared = dict(chunks[first_chunk].named_parameters())[WORD_EMBEDDING]
            holder = chunks[last_chunk].get_submodule(WORD_EMBEDDING.rsplit(".", 1)[0])
            holder.weight = shared
        return
    if {first_rank, last_rank} != {0, state.pp_size - 1}:
        raise ValueError(
            f"--pipeline-schedule {schedule.name} places the embedding on rank {first_rank} and the output layer "
            f"on rank {last_rank}; tied embeddings need them on the first and last pipeline rank "
            f"(use --untie-embeddings-and-output-weights)"
        )
