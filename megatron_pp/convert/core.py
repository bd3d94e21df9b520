"""The streaming core every checkpoint conversion runs on: readers, parameter specs, layouts, safe output.

A reader shows a checkpoint as a `TransformerConfig` plus full (unsharded) tensors under megatron_pp's
global parameter names, read on demand. A writer walks the parameters a model of that config has
(`stage_parameters`, read off a `StageModel` built on the meta device, so names, shapes and
tensor-parallel splits have one source of truth) and pulls one full tensor at a time (`full_tensor`),
which bounds peak memory by one output file plus one full tensor. Every writer stages its output in a
directory beside the target and renames it into place when complete (`staged_output`), so an
interrupted conversion leaves nothing that looks like a checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from megatron_pp.core.tensor_parallel import param_is_partitioned, shard_tensor
from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.models.hf import VOCAB_PARAMETERS, resize_vocab_rows
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.models.transformer import StageModel
from megatron_pp.schedules.generators import looped_placement
from megatron_pp.training.checkpointing import TRACKER_FILE, CheckpointError, fsync_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
"""Files carried along with the weights (generation_config.json too: it holds the token ids to stop on)."""


# Parameters and shards ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterSpec:
    """A parameter's full shape (vocabulary rows unpadded: `config.vocab_size`) and its TP split."""

    shape: tuple[int, ...]
    partitioned: bool
    partition_dim: int
    partition_stride: int


def stage_parameters(config: TransformerConfig, spec: StageSpec) -> dict[str, ParameterSpec]:
    """Every entry of a stage's state dict, in order, read off a model built on the meta device."""
    model = StageModel(config, spec, device=torch.device("meta"))
    params = {}
    for name, param in model.state_dict(keep_vars=True).items():
        shape = tuple(param.shape)
        if name in VOCAB_PARAMETERS:
            shape = (config.vocab_size, *shape[1:])
        params[name] = ParameterSpec(shape, param_is_partitioned(param), getattr(param, "partition_dim", 0),
                                     getattr(param, "partition_stride", 1))
    return params


def model_parameters(config: TransformerConfig) -> dict[str, ParameterSpec]:
    """`stage_parameters` of the whole model as one stage."""
    return stage_parameters(config, split_layers(config.num_layers, 1)[0])


def join_shards(shards: list[torch.Tensor], param: ParameterSpec) -> torch.Tensor:
    """The full tensor from every TP rank's shard, in rank order (the offline inverse of `shard_tensor`)."""
    if not param.partitioned or len(shards) == 1:
        return shards[0]
    dim, stride = param.partition_dim, param.partition_stride
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[rank][block] for block in range(stride) for rank in range(len(shards))], dim=dim)


def compact(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A copy with storage of its own, cast to `dtype` if given.

    Saving a view (a slice of a padded embedding, a memory-mapped source) would otherwise write, or
    keep alive, the whole storage it points into.
    """
    return tensor.to(dtype=dtype or tensor.dtype, memory_format=torch.contiguous_format, copy=True)


def padded_shape(name: str, param: ParameterSpec, padded_vocab: int) -> tuple[int, ...]:
    """The shape a file holds: vocabulary tensors with `padded_vocab` rows, others as they are."""
    return (padded_vocab, *param.shape[1:]) if name in VOCAB_PARAMETERS else param.shape


def layer_of(name: str) -> Optional[int]:
    """The global layer number of a `layers.N.…` parameter, None for the others."""
    return int(name.split(".")[1]) if name.startswith("layers.") else None


# Readers ------------------------------------------------------------------------------------------------


class CheckpointReader(ABC):
    """A checkpoint seen as its model config and full tensors under megatron_pp's global names.

    Vocabulary tensors may come with padding rows (any number >= `config.vocab_size`); writers resize.
    """

    config: TransformerConfig
    iteration: int = 0
    consumed_samples: int = 0
    tokenizer_dir: Optional[str] = None
    """A directory holding the checkpoint's tokenizer files, if it has any."""
    hf_config: Optional[dict] = None
    """The Hugging Face config.json the weights came from, if known."""

    @abstractmethod
    def tensor(self, name: str) -> torch.Tensor:
        """The full tensor of global parameter `name` (read now; the reader keeps no reference to it)."""

    def close(self) -> None:
        """Release open files."""

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def full_tensor(reader: CheckpointReader, name: str, shape: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """`reader.tensor(name)`, vocabulary rows resized to `shape[0]`, checked against `shape`."""
    tensor = reader.tensor(name)
    if name in VOCAB_PARAMETERS:
        if tensor.shape[0] < vocab_size:
            raise CheckpointError(f"{name} has {tensor.shape[0]} rows, fewer than the vocabulary size {vocab_size}")
        tensor = resize_vocab_rows(tensor, shape[0])
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{name}: the source holds shape {list(tensor.shape)}, the model config implies "
                              f"{list(shape)}")
    return tensor


def tp_shard(reader: CheckpointReader, config: TransformerConfig, name: str, param: ParameterSpec, rank: int,
             tp: int, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Parameter `name` as TP rank `rank` of `tp` holds it: the full tensor with its vocabulary rows padded
    for `tp`, split along its partition dimension (strided where the parameter is), cast to `dtype` and
    compact. What the megatron_pp and Megatron-LM `torch` writers save per rank."""
    value = full_tensor(reader, name, padded_shape(name, param, config.padded_vocab_size(tp)), config.vocab_size)
    if param.partitioned:
        value = shard_tensor(value, param.partition_dim, param.partition_stride, rank, tp)
    return compact(value, dtype)


def write_tracker(staging: str, iteration: int, tokenizer_dir: Optional[str], tokenizer_subdir: str) -> None:
    """Beside the iteration directories: the tracker file naming `iteration`, and the tokenizer files (when
    given) in `tokenizer_subdir`, as megatron_pp and both Megatron-LM formats keep them."""
    with open(os.path.join(staging, TRACKER_FILE), "w") as f:
        f.write(f"{iteration}\n")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, os.path.join(staging, tokenizer_subdir))


def has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, name))
               for name in TOKENIZER_FILES if name != "generation_config.json")


def copy_tokenizer(tokenizer_dir: str, destination: str) -> None:
    for name in TOKENIZER_FILES:
        source = os.path.join(tokenizer_dir, name)
        if os.path.isfile(source):
            os.makedirs(destination, exist_ok=True)
            shutil.copyfile(source, os.path.join(destination, name))


def tokenizer_vocab_size(directory: str) -> Optional[int]:
    """Token ids the tokenizer in `directory` can produce (largest id + 1), or None if it has none we read."""
    import json

    path = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer

        return 1 + max(Tokenizer.from_file(path).get_vocab(with_added_tokens=True).values())
    path = os.path.join(directory, "tokenizer.model")
    if os.path.isfile(path):
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=path).get_piece_size()
    ids: list[int] = []
    for name in ("vocab.json", "added_tokens.json"):
        if os.path.isfile(os.path.join(directory, name)):
            with open(os.path.join(directory, name)) as f:
                ids += list(json.load(f).values())
    return 1 + max(ids) if ids else None


def check_vocabulary(config: TransformerConfig, tokenizer_dir: str) -> None:
    """Refuse a model whose embedding has fewer rows than the tokenizer has token ids."""
    tokens = tokenizer_vocab_size(tokenizer_dir)
    if tokens is not None and tokens > config.vocab_size:
        raise CheckpointError(
            f"the tokenizer in {tokenizer_dir} produces ids up to {tokens - 1}, but the model's vocabulary has only "
            f"{config.vocab_size} rows: ids {config.vocab_size}..{tokens - 1} would have no embedding"
        )


# Target layouts -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetLayout:
    """The parallel layout of a checkpoint to write (the training run's flags, same meaning)."""

    tp: int = 1
    pp: int = 1
    vp: Optional[int] = None
    """Virtual stages (model chunks) per pipeline rank; None: from `layers_per_virtual_stage`, else 1."""
    layers_per_virtual_stage: Optional[int] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    account_for_embedding: bool = False
    account_for_loss: bool = False
    schedule: Optional[str] = None
    """The run's --pipeline-schedule, which places the stages on ranks (and fixes the chunk count of the V
    shapes); None: the interleaved placement of every schedule but the V shapes."""

    def num_chunks(self, num_layers: int) -> int:
        if self.vp is not None and self.layers_per_virtual_stage is not None:
            raise ValueError("--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage "
                             "are mutually exclusive")
        if self.layers_per_virtual_stage is None:
            if self.vp is None and self.schedule is not None:
                from megatron_pp.schedules.registry import get_schedule

                return get_schedule(self.schedule).chunks_per_rank or 1  # as training: the V shapes' 2
            return 1 if self.vp is None else self.vp
        slots = num_layers + int(self.account_for_embedding) + int(self.account_for_loss)
        per_stage = self.layers_per_virtual_stage
        if per_stage < 1 or slots % (self.pp * per_stage) != 0:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_stage} does not divide {slots} layer slots "
                             f"into --pipeline-model-parallel-size {self.pp} ranks evenly")
        return slots // (self.pp * per_stage)

    def training_flags(self) -> list[str]:
        """The pretrain_*.py flags that build this layout."""
        flags = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.schedule is not None:
            flags += ["--pipeline-schedule", self.schedule]
        for name, value in (("--num-virtual-stages-per-pipeline-rank", self.vp),
                            ("--num-layers-per-virtual-pipeline-stage", self.layers_per_virtual_stage),
                            ("--decoder-first-pipeline-num-layers", self.first_stage_layers),
                            ("--decoder-last-pipeline-num-layers", self.last_stage_layers)):
            if value is not None:
                flags += [name, str(value)]
        if self.account_for_embedding:
            flags.append("--account-for-embedding-in-pipeline-split")
        if self.account_for_loss:
            flags.append("--account-for-loss-in-pipeline-split")
        return flags

    def placement(self, num_layers: int) -> list[tuple[int, int]]:
        """(rank, chunk) of each global stage, as the training run places them."""
        chunks = self.num_chunks(num_layers)
        if self.schedule is None:
            return looped_placement(self.pp, chunks)
        from megatron_pp.schedules.registry import stage_placement

        return stage_placement(self.schedule, self.pp, chunks)

    def stages(self, num_layers: int) -> list[StageSpec]:
        # The same split as the run's (`build_pipeline`): the uneven flags count the layers of the rank that
        # holds the first stage and of the one that holds the last, which depends on the placement.
        return split_layers(num_layers, self.pp, self.num_chunks(num_layers),
                            first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
                            account_for_embedding=self.account_for_embedding, account_for_loss=self.account_for_loss,
                            placement=self.placement(num_layers))

    def checked_stages(self, config: TransformerConfig, interleaved_only: bool = False) -> list[StageSpec]:
        """`stages` after checking that `config` fits this layout; errors name the converter's --target-* flags.
        `interleaved_only`: refuse a placement other than the interleaved one (Megatron-LM targets)."""
        try:
            config.validate(self.tp)
            stages = self.stages(config.num_layers)
            chunks = self.num_chunks(config.num_layers)
        except ValueError as exc:
            raise CheckpointError(_LAYOUT_FLAGS.sub(
                lambda m: "--target-" + _SHORT_TARGET_FLAGS.get(m.group(1), m.group(1)), str(exc))) from None
        if interleaved_only and self.placement(config.num_layers) != looped_placement(self.pp, chunks):
            raise CheckpointError(f"--target-pipeline-schedule {self.schedule} does not place stage g on rank g mod p "
                                  "(Megatron-LM's only placement), so Megatron-LM cannot run it; convert to "
                                  "--target-format megatron_pp")
        return stages


_LAYOUT_FLAGS = re.compile(r"--(tensor-model-parallel-size|pipeline-model-parallel-size|pipeline-schedule|"
                           r"num-virtual-stages-per-pipeline-rank|num-layers-per-virtual-pipeline-stage|"
                           r"decoder-first-pipeline-num-layers|decoder-last-pipeline-num-layers|"
                           r"account-for-embedding-in-pipeline-split|account-for-loss-in-pipeline-split)")
_SHORT_TARGET_FLAGS = {"tensor-model-parallel-size": "tensor-parallel-size",
                       "pipeline-model-parallel-size": "pipeline-parallel-size"}


def training_flags(config: TransformerConfig) -> list[str]:
    """Command-line flags of pretrain_*.py that build exactly this model (to train a converted checkpoint)."""
    skipped = {"params_dtype", "attention_backend", "hidden_dropout", "attention_dropout", "init_method_std",
               "add_bias_linear", "untie_embeddings_and_output_weights", "apply_layernorm_1p"}
    flags: list[str] = []
    for field in dataclasses.fields(TransformerConfig):
        value = getattr(config, field.name)
        if field.name not in skipped and value is not None:
            flags += [flag(field.name), str(value)]
    if not config.add_bias_linear:
        flags.append("--disable-bias-linear")
    if config.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if config.apply_layernorm_1p:  # an on/off flag: it takes no value
        flags.append("--apply-layernorm-1p")
    return flags


# Safe output --------------------------------------------------------------------------------------------


def check_empty_target(save_dir: str) -> None:
    if os.path.exists(save_dir) and (not os.path.isdir(save_dir) or os.listdir(save_dir)):
        raise CheckpointError(f"--save-dir {save_dir} exists and is not empty; choose a new directory")


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _publish(staging: str, save_dir: str) -> None:
    """Make the complete `staging` tree appear as `save_dir` in one rename."""
    for directory, _, files in os.walk(staging):
        for name in files:
            _fsync_file(os.path.join(directory, name))
        fsync_dir(directory)
    if os.path.isdir(save_dir):
        os.rmdir(save_dir)  # empty (checked before writing); rename cannot replace a directory otherwise
    os.rename(staging, save_dir)
    fsync_dir(os.path.dirname(os.path.abspath(save_dir)))


@contextlib.contextmanager
def staged_output(save_dir: str) -> Iterator[str]:
    """A fresh directory beside `save_dir` to write into; renamed to `save_dir` when the block completes,
    removed when it raises. `save_dir` must be new or empty."""
    check_empty_target(save_dir)
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=os.path.basename(os.path.abspath(save_dir)) + ".partial-", dir=parent)
    try:
        yield staging
        _publish(staging, save_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
