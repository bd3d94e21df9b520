"""The decoder-only transformer, one pipeline stage at a time, readable top to bottom.

GPT (learned positions, LayerNorm, GELU, biases, tied output) and LLaMA (RoPE, RMSNorm, SwiGLU, grouped-
query attention, no biases, untied output) are the same architecture under different `TransformerConfig`
values. A `StageModel` holds what one global pipeline stage (`StageSpec`) owns: a range of layers, plus
the embedding on the first stage and the final norm, output layer and loss on the last. Layers sit in a
ModuleDict keyed by their *global* index, so a parameter is called e.g.
`layers.7.self_attention.linear_qkv.weight` whatever the pipeline split.

Tensors are sequence-first: hidden states are `[s, b, h]`, or this rank's `[s/tp, b, h]` rows under
sequence parallelism. Matrices are split over the tensor-parallel group Megatron-style: QKV and fc1
column-parallel, the attention output projection and fc2 row-parallel, the vocabulary split across ranks
for the embedding, the output layer and the cross-entropy.

Initialisation does not depend on the layout: every parameter's full tensor is defined by a generator
seeded by (seed, parameter name), and `init_stage_weights` gives each rank exactly its slice of it
(drawing only that slice), so tp=1, tp=4, a 2-stage pipeline or an interleaved one all start from
bit-identical weights.

Activation recomputation (`RecomputeConfig`, Megatron's `--recompute-*` flags) trades compute for
memory: a checkpointed span keeps only its inputs for the backward, which reruns it. It uses
non-reentrant `torch.utils.checkpoint`, whose inputs are saved through the ordinary saved-tensor
hooks, so the pipeline's activation store sees (and can offload) exactly what is kept; dropout
replays the same masks because both the default generator and the TP RNG tracker's streams are
restored for the rerun (`checkpoint_with_rng`).

This file assembles a stage; its parts live beside it: `layers.py` (embedding, attention block, MLP, the
transformer layer), `ops.py` (norms, rotary embeddings, dropout), `recompute.py` and `init.py`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup

from megatron_pp.core.tensor_parallel import (
    ColumnParallelLinear,
    RNGTracker,
    column_parallel_linear,
    gather_tensor,
    get_rng_tracker,
    param_is_partitioned,
    tp_size,
    vocab_parallel_cross_entropy,
)
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.init import init_stage_weights
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.models.layers import Embedding, TransformerLayer
from megatron_pp.models.ops import Norm, Rotary, hidden_dropout, rotary_cos_sin
from megatron_pp.models.recompute import RecomputeConfig, checkpoint_with_rng


# One pipeline stage -------------------------------------------------------------------------------------


class StageModel(nn.Module):
    """The layers, and possibly embedding and head, of one global pipeline stage.

    `forward(hidden, batch)`:
      - `batch["tokens"]` `[b, s]` int64 and `batch["labels"]` `[b, s]` int64; optional
        `batch["position_ids"]` `[b, s]` (default 0..s-1) and, for packed documents, `batch["cu_seqlens"]`
        (int32 boundaries over the flattened `b * s` tokens, see `models.attention`) with optional
        `batch["max_seqlen"]`.
      - the first stage ignores `hidden` (pass None) and embeds the tokens; other stages take `hidden`
        `[s, b, h]` (`[s/tp, b, h]` under sequence parallelism) from the previous stage.
      - a stage without the head returns hidden states in the same layout; the last stage returns the
        per-token loss `[b, s]` in fp32, unreduced (masking and averaging belong to the pipeline executor).

    With tied embeddings and the head on a different stage than the embedding, the head stage keeps its
    own copy of the word embedding under the same name, `embedding.word_embeddings.weight`; both copies
    are tagged `shared_embedding=True` and the training code must sum their gradients (all-reduce over
    the embedding group) so they stay equal. On a stage holding both, it is a single parameter.

    Weights are left uninitialised unless `seed` is given (then `init_stage_weights(self, seed)`), so a
    model about to load a checkpoint pays nothing for initialisation. `recompute` (see `RecomputeConfig`)
    is read at every forward, so it may also be changed on a built model.
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: StageSpec,
        *,
        tp_group: Optional[ProcessGroup] = None,
        sequence_parallel: bool = False,
        device: Optional[torch.device] = None,
        seed: Optional[int] = None,
        rng_tracker: Optional[RNGTracker] = None,
        recompute: Optional[RecomputeConfig] = None,
    ):
        super().__init__()
        tp = tp_size(tp_group)
        config.validate(tp)
        if not 0 <= spec.layer_start <= spec.layer_end <= config.num_layers:
            raise ValueError(
                f"stage {spec.stage} holds layers [{spec.layer_start}, {spec.layer_end}) outside --num-layers "
                f"{config.num_layers}"
            )
        sequence_parallel = sequence_parallel and tp > 1
        if sequence_parallel and config.seq_length % tp != 0:
            raise ValueError(
                f"--seq-length {config.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
                f"(required by --sequence-parallel)"
            )
        self.config = config
        self.spec = spec
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.rng_tracker = rng_tracker if rng_tracker is not None else get_rng_tracker()
        self.recompute = recompute if recompute is not None else RecomputeConfig()
        tied = not config.untie_embeddings_and_output_weights

        self.embedding: Optional[Embedding] = None
        if spec.has_embedding or (spec.has_head and tied):
            self.embedding = Embedding(config, tp_group, sequence_parallel, device, with_positions=spec.has_embedding)
            if tied and not (spec.has_embedding and spec.has_head):
                self.embedding.word_embeddings.weight.shared_embedding = True

        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(config, tp_group, sequence_parallel, self.rng_tracker, device)
                for i in spec.layers
            }
        )

        self.final_layernorm: Optional[Norm] = None
        self.output_layer: Optional[ColumnParallelLinear] = None
        if spec.has_head:
            self.final_layernorm = Norm(config, sequence_parallel, device)
            if not tied:
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, config.padded_vocab_size(tp), tp_group=tp_group, bias=False,
                    sequence_parallel=sequence_parallel, params_dtype=config.params_dtype, device=device,
                )
        # Megatron-LM's tag for --decoupled-lr: the word embedding (either copy) and the output layer's weight.
        for module in (self.embedding.word_embeddings if self.embedding is not None else None, self.output_layer):
            if module is not None:
                module.weight.is_embedding_or_output_parameter = True
        if seed is not None:
            init_stage_weights(self, seed)

    def forward(self, hidden: Optional[torch.Tensor], batch: Mapping[str, Any]) -> torch.Tensor:
        tokens = batch["tokens"]
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)

        if self.spec.has_embedding:
            hidden = self.embedding(tokens, position_ids)
            hidden = hidden_dropout(hidden, self.config.hidden_dropout, training=self.training,
                                    sequence_parallel=self.sequence_parallel, rng_tracker=self.rng_tracker)
        rotary = None
        if self.config.position_embedding_type == "rope":
            rotary = rotary_cos_sin(position_ids, self.config.rotary_dim, self.config.rotary_base)
        hidden = self._run_layers(hidden, rotary, batch.get("cu_seqlens"), batch.get("max_seqlen"))
        if not self.spec.has_head:
            return hidden

        logits = self._logits(self.final_layernorm(hidden))  # [s, b, V/tp]
        return vocab_parallel_cross_entropy(logits, batch["labels"].t(), self.tp_group).t()

    def _run_layers(
        self, hidden: torch.Tensor, rotary: Optional[Rotary], cu_seqlens: Optional[torch.Tensor],
        max_seqlen: Optional[int],
    ) -> torch.Tensor:
        layers = list(self.layers.values())
        selective = self.recompute.granularity == "selective"
        cos, sin = rotary if rotary is not None else (None, None)

        def span(start: int, end: int) -> Callable[..., torch.Tensor]:
            # Tensors travel as separate arguments so a checkpoint saves (and the store counts) each one.
            def run(x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                    cu_seqlens: Optional[torch.Tensor], max_seqlen: Optional[int]) -> torch.Tensor:
                rot = None if cos is None else (cos, sin)
                for layer in layers[start:end]:
                    x = layer(x, rot, cu_seqlens, max_seqlen, selective)
                return x
            return run

        for start, end, checkpointed in self.recompute.checkpointed_spans(len(layers)):
            args = (hidden, cos, sin, cu_seqlens, max_seqlen)
            if checkpointed and torch.is_grad_enabled():
                hidden = checkpoint_with_rng(span(start, end), self.rng_tracker, *args)
            else:
                hidden = span(start, end)(*args)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer(hidden)
        # Tied: the same column-parallel product, with the word embedding's vocabulary shard as weight
        # (under sequence parallelism it saves only this rank's sequence shard, not the gathered input).
        return column_parallel_linear(
            hidden, self.embedding.word_embeddings.weight, None, self.tp_group, sequence_parallel=self.sequence_parallel
        )


def build_model(config: TransformerConfig, seed: int, device: Optional[torch.device] = None) -> StageModel:
    """The whole model as one stage on one process: the single-process reference for every layout."""
    (spec,) = split_layers(config.num_layers, 1)
    return StageModel(config, spec, device=device, seed=seed)


def full_named_parameters(stage_models: Iterable[StageModel], *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full (TP-gathered) parameters, or their gradients, of some stages, by global name, on CPU.

    Collective over the stages' TP group: every TP rank must call it with the same stages. A name held by several
    stages (the tied word embedding's copy on the head stage) appears once: for parameters the first
    stage's value, for gradients the sum, which is what the training code's embedding all-reduce
    produces. Gradients of parameters tagged `sequence_parallel` are returned as this rank holds them;
    sum them over TP first, as the training code does.
    """
    full: dict[str, torch.Tensor] = {}
    for model in stage_models:
        for name, param in model.named_parameters():
            tensor = param.grad if grads else param
            if tensor is None:
                raise ValueError(f"parameter {name} has no gradient; run a backward first")
            if param_is_partitioned(param):
                tensor = gather_tensor(tensor, param.partition_dim, param.partition_stride, model.tp_group)
            tensor = tensor.detach().cpu().clone()
            if name not in full:
                full[name] = tensor
            elif grads:
                full[name] += tensor
    return full
