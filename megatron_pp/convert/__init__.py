"""Checkpoint conversion between Hugging Face, megatron_pp, Megatron-LM (`torch`) and Megatron-Core
(`torch_dist`) checkpoints, streamed tensor by tensor.

Every conversion is a reader feeding a writer around the streaming core (`core`): one module per
format holds both (`hf`, `megatron_pp`, `megatron_lm`, `torch_dist`). `convert_checkpoint` picks them,
applies the vocabulary options and reports what was written. A converted checkpoint holds model
weights only (a megatron_pp one loads with `--finetune`; see docs/checkpoint_conversion.md).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec
from megatron_pp.training.checkpointing import CheckpointError, config_from_json, config_to_json, model_file
from megatron_pp.convert.core import (
    CheckpointReader,
    TargetLayout,
    check_vocabulary,
    full_tensor,
    model_parameters,
    stage_parameters,
    training_flags,
)
from megatron_pp.convert.hf import DEFAULT_MAX_SHARD_BYTES, HFReader, write_hf
from megatron_pp.convert.megatron_lm import (
    MEGATRON_LM_FILE,
    TRANSFORMER_IMPLS,
    MegatronLMReader,
    rank_directory,
    write_megatron_lm,
)
from megatron_pp.convert.megatron_pp import MegatronPPReader, write_megatron_pp
from megatron_pp.convert.torch_dist import TorchDistReader, write_torch_dist

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES", "SOURCE_FORMATS", "TARGET_FORMATS", "TRANSFORMER_IMPLS", "CheckpointReader",
    "Conversion", "TargetLayout", "config_from_json", "config_to_json", "convert_checkpoint", "model_parameters",
    "open_reader", "read_full_state", "stage_parameters", "training_flags",
]

SOURCE_FORMATS = ("hf", "megatron_pp", "megatron_lm", "torch_dist")
TARGET_FORMATS = ("hf", "megatron_pp", "megatron_lm", "torch_dist")


def open_reader(source_format: str, load_dir: str, *, true_vocab_size: Optional[int] = None) -> CheckpointReader:
    if source_format == "hf":
        return HFReader(load_dir)
    if source_format == "megatron_pp":
        return MegatronPPReader(load_dir)
    if source_format == "megatron_lm":
        return MegatronLMReader(load_dir, true_vocab_size=true_vocab_size)
    if source_format == "torch_dist":
        return TorchDistReader(load_dir, true_vocab_size=true_vocab_size)
    raise ValueError(f"--source-format {source_format!r} is not one of {', '.join(SOURCE_FORMATS)}")


@dataclass(frozen=True)
class Conversion:
    """What a conversion wrote."""

    save_dir: str
    config: TransformerConfig
    files: list[str]
    stages: Optional[list[StageSpec]] = None
    """The layer split written (megatron_pp and Megatron-LM targets)."""
    iteration: int = 0
    """The source's training position (0 for a Hugging Face source), kept by every target but Hugging Face."""
    consumed_samples: int = 0


def convert_checkpoint(
    source_format: str,
    target_format: str,
    load_dir: str,
    save_dir: str,
    *,
    layout: TargetLayout = TargetLayout(),
    dtype: Optional[torch.dtype] = None,
    tokenizer_dir: Optional[str] = None,
    make_vocab_size_divisible_by: Optional[int] = None,
    true_vocab_size: Optional[int] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    transformer_impl: str = "transformer_engine",
    progress: bool = True,
) -> Conversion:
    """Convert the checkpoint in `load_dir` to `target_format` in `save_dir` (which must be new or empty).

    `tokenizer_dir` replaces the tokenizer files the source carries (if any); the vocabulary must cover
    every id the tokenizer produces. `make_vocab_size_divisible_by` changes the padding rule of the
    target (default: the source's, 128 for Hugging Face sources). `true_vocab_size` is the real
    vocabulary: embedding rows beyond it are dropped (for a Megatron-LM source it also says where the
    padding starts, which its files do not record). `transformer_impl` picks the module names of a
    Megatron-LM `torch` target (TransformerEngine's fused norms or the local modules).
    """
    if target_format not in TARGET_FORMATS:
        raise ValueError(f"--target-format {target_format!r} is not one of {', '.join(TARGET_FORMATS)}")
    if os.path.abspath(load_dir) == os.path.abspath(save_dir):
        raise CheckpointError("--load-dir and --save-dir are the same directory")
    with open_reader(source_format, load_dir, true_vocab_size=true_vocab_size) as reader:
        config = reader.config
        if true_vocab_size is not None:
            if true_vocab_size > config.vocab_size:
                raise CheckpointError(f"--true-vocab-size {true_vocab_size} is larger than the checkpoint's "
                                      f"vocabulary of {config.vocab_size}")
            config = dataclasses.replace(config, vocab_size=true_vocab_size)
        if make_vocab_size_divisible_by is not None:
            config = dataclasses.replace(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        tokenizer_dir = tokenizer_dir or reader.tokenizer_dir
        if tokenizer_dir is not None:
            check_vocabulary(config, tokenizer_dir)
        saved = dataclasses.replace(config, params_dtype=dtype or config.params_dtype)
        position = dict(iteration=int(getattr(reader, "iteration", 0) or 0),
                        consumed_samples=int(getattr(reader, "consumed_samples", 0) or 0))
        common = dict(dtype=dtype, tokenizer_dir=tokenizer_dir, progress=progress)
        if target_format == "hf":
            files = write_hf(reader, config, save_dir, max_shard_bytes=max_shard_bytes, **common)
            return Conversion(save_dir, config, files)
        if target_format == "megatron_pp":
            stages = write_megatron_pp(reader, config, save_dir, layout, **common,
                                       source={"format": source_format, "path": os.path.abspath(load_dir)})
            files = sorted(model_file(s.stage, r) for s in stages for r in range(layout.tp))
            return Conversion(save_dir, saved, files, stages, **position)
        if target_format == "megatron_lm":
            stages = write_megatron_lm(reader, config, save_dir, layout, transformer_impl=transformer_impl, **common)
            files = sorted(os.path.join(rank_directory(t, p, layout.pp), MEGATRON_LM_FILE)
                           for t in range(layout.tp) for p in range(layout.pp))
            return Conversion(save_dir, saved, files, stages, **position)
        stages = write_torch_dist(reader, config, save_dir, layout, transformer_impl=transformer_impl, **common)
        files = sorted(name for name in os.listdir(_only_iteration(save_dir)) if name.endswith(".distcp"))
        return Conversion(save_dir, saved, files, stages, **position)


def _only_iteration(save_dir: str) -> str:
    (name,) = [n for n in os.listdir(save_dir) if n.startswith("iter_")]
    return os.path.join(save_dir, name)


def read_full_state(load_dir: str, source_format: str = "megatron_pp") -> Iterator[tuple[str, torch.Tensor]]:
    """Every full tensor of a checkpoint by global name, one at a time (vocabulary rows unpadded)."""
    with open_reader(source_format, load_dir) as reader:
        for name, param in model_parameters(reader.config).items():
            yield name, full_tensor(reader, name, param.shape, reader.config.vocab_size)
