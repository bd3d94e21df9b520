"""megatron_pp's own checkpoints, both ways: per-global-stage, per-TP-rank model files plus metadata.json.

`MegatronPPReader` reads what `checkpointing.save_checkpoint` (or `write_megatron_pp`) wrote, one
global stage's files memory-mapped at a time. `write_megatron_pp` shards for any tp / pp / virtual
stages / uneven split and writes the metadata `load_checkpoint` accepts (the source's iteration and consumed
samples), without optimizer or RNG files: load it with `--no-load-optim --no-load-rng` to continue the run, or
`--finetune` to start a new one. Resharding is this reader feeding this writer.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch
from tqdm import tqdm

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec
from megatron_pp.training.checkpointing import (
    FORMAT_VERSION,
    METADATA_FILE,
    TRACKER_FILE,
    CheckpointError,
    config_from_json,
    config_to_json,
    iteration_dir,
    model_file,
    model_shape,
    read_metadata,
    read_tracker,
    write_json,
)
from megatron_pp.convert.core import (
    CheckpointReader,
    TargetLayout,
    join_shards,
    layer_of,
    model_parameters,
    stage_parameters,
    staged_output,
    tp_shard,
    write_tracker,
)

TOKENIZER_DIR = "tokenizer"
"""Where a megatron_pp checkpoint keeps the tokenizer files, beside latest_checkpointed_iteration.txt."""
HF_CONFIG_FILE = "hf_config.json"
"""The config.json a megatron_pp checkpoint was imported from, kept so an export restores its token ids."""


class MegatronPPReader(CheckpointReader):
    """A checkpoint written by `checkpointing.save_checkpoint` (or by this module): its newest iteration,
    or the `iter_*` directory given. Shard files are memory-mapped, one global stage at a time."""

    def __init__(self, load_dir: str):
        directory, root = _megatron_pp_directory(load_dir)
        metadata = read_metadata(directory)
        self.config = config_from_json(metadata["model"])
        self.iteration = int(metadata["iteration"])
        self.consumed_samples = int(metadata.get("consumed_samples", 0))
        layout = metadata["layout"]
        self._directory = directory
        self._tp = int(layout["tp"])
        stages = [StageSpec(**stage) for stage in layout["stages"]]
        self._params = model_parameters(self.config)
        self._owner = {name: _owning_stage(name, stages) for name in self._params}
        self._stage: Optional[int] = None
        self._shards: list[dict[str, torch.Tensor]] = []
        if os.path.isdir(os.path.join(root, TOKENIZER_DIR)):
            self.tokenizer_dir = os.path.join(root, TOKENIZER_DIR)
        if os.path.isfile(os.path.join(root, HF_CONFIG_FILE)):
            with open(os.path.join(root, HF_CONFIG_FILE)) as f:
                self.hf_config = json.load(f)

    def tensor(self, name: str) -> torch.Tensor:
        stage = self._owner[name]
        if stage != self._stage:
            self._shards = []  # drop the previous stage's mappings before opening the next
            for rank in range(self._tp):
                path = os.path.join(self._directory, model_file(stage, rank))
                if not os.path.isfile(path):
                    raise CheckpointError(f"{path}: missing from the checkpoint")
                self._shards.append(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"])
            self._stage = stage
        try:
            return join_shards([shard[name] for shard in self._shards], self._params[name])
        except KeyError:
            raise CheckpointError(f"{self._directory}: the stage {stage} files lack parameter {name}") from None

    def close(self) -> None:
        self._shards, self._stage = [], None


def _megatron_pp_directory(load_dir: str) -> tuple[str, str]:
    """(iteration directory, checkpoint root) for a root with a tracker file or an `iter_*` directory."""
    if os.path.isfile(os.path.join(load_dir, METADATA_FILE)):
        return load_dir, os.path.dirname(os.path.abspath(load_dir))
    iteration = read_tracker(load_dir) if os.path.isdir(load_dir) else None
    if iteration is None:
        raise CheckpointError(f"{load_dir}: no {TRACKER_FILE} and no {METADATA_FILE} (not a megatron_pp checkpoint)")
    return iteration_dir(load_dir, iteration), load_dir


def _owning_stage(name: str, stages: list[StageSpec]) -> int:
    """The global stage whose files hold `name` (the word embedding: the first stage's, not the head's copy)."""
    layer = layer_of(name)
    if layer is not None:
        return next(s.stage for s in stages if s.layer_start <= layer < s.layer_end)
    return 0 if name.startswith("embedding.") else stages[-1].stage


def write_megatron_pp(
    reader: CheckpointReader,
    config: TransformerConfig,
    save_dir: str,
    layout: TargetLayout,
    *,
    dtype: Optional[torch.dtype] = None,
    tokenizer_dir: Optional[str] = None,
    source: Optional[dict] = None,
    progress: bool = True,
) -> list[StageSpec]:
    """Write `reader`'s weights as a megatron_pp checkpoint of `config` split as `layout`; returns the stages.

    The files are the ones `checkpointing.save_checkpoint` writes for model weights (one
    `model_stageSSS_tpTT.pt` per global stage and TP rank) with a metadata.json that `load_checkpoint`
    accepts, but no optimizer or RNG files. Vocabulary tensors are padded to `padded_vocab_size(tp)`.
    """
    stages = layout.checked_stages(config)
    per_stage = [stage_parameters(config, spec) for spec in stages]
    with staged_output(save_dir) as staging:
        directory = iteration_dir(staging, reader.iteration)
        os.makedirs(directory)
        total = sum(len(params) for params in per_stage) * layout.tp
        with tqdm(total=total, desc="megatron_pp shards", unit="tensor", disable=not progress) as bar:
            for spec, params in zip(stages, per_stage):
                for rank in range(layout.tp):
                    shard = {}
                    for name, param in params.items():
                        shard[name] = tp_shard(reader, config, name, param, rank, layout.tp, dtype)
                        bar.update()
                    torch.save({"model": shard}, os.path.join(directory, model_file(spec.stage, rank)))
        saved = dataclasses.replace(config, params_dtype=dtype or config.params_dtype)
        num_chunks = layout.num_chunks(config.num_layers)
        write_json(os.path.join(directory, METADATA_FILE), {
            "format_version": FORMAT_VERSION,
            "iteration": reader.iteration,
            "consumed_samples": reader.consumed_samples,
            "world_size": layout.tp * layout.pp,
            "layout": {"tp": layout.tp, "pp": layout.pp, "dp": 1, "num_chunks": num_chunks,
                       "placement": [list(p) for p in layout.placement(config.num_layers)],
                       "stages": [dataclasses.asdict(s) for s in stages]},
            "schedule": None,
            "model": config_to_json(saved),
            "model_shape": model_shape(saved),
            "optimizer": {"saved": False, "sharded_by_dp": False},
            "converted_from": source or {},
        })
        write_tracker(staging, reader.iteration, tokenizer_dir, TOKENIZER_DIR)
        if reader.hf_config is not None:
            write_json(os.path.join(staging, HF_CONFIG_FILE), reader.hf_config)
    return stages
