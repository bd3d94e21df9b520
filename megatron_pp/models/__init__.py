"""Model definitions: the transformer config and presets, attention backends, pipeline-stage layout, and
the per-stage GPT/LLaMA model (`transformer.py`, the file to read first).

The attention function is not re-exported here: its name would hide the `models.attention` module."""
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.init import init_stage_weights
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.models.presets import get_preset, preset_names
from megatron_pp.models.transformer import StageModel, build_model, full_named_parameters

__all__ = [
    "StageModel",
    "StageSpec",
    "TransformerConfig",
    "build_model",
    "full_named_parameters",
    "get_preset",
    "init_stage_weights",
    "preset_names",
    "split_layers",
]
