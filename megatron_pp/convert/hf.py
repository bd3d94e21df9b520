"""Hugging Face checkpoints (`LlamaForCausalLM`, `GPT2LMHeadModel`): config.json plus safetensors, both ways.

`HFReader` opens safetensors shards lazily with `safe_open` (only a requested tensor is read) and checks,
before reading any weight, that every tensor the model needs is there with the shape config.json
implies. `write_hf` writes shards of at most `max_shard_bytes` and a config.json that `from_pretrained`
loads. The name and layout mapping (QKV regrouping, SwiGLU split, Conv1D transposes) lives in
`megatron_pp.models.hf`; this module only does the file I/O.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.hf import canonical_hf_name, config_from_hf, hf_config_from, is_ignored_hf_name, tensor_maps
from megatron_pp.training.checkpointing import CheckpointError, write_json
from megatron_pp.convert.core import (
    CheckpointReader,
    compact,
    copy_tokenizer,
    full_tensor,
    has_tokenizer,
    model_parameters,
    staged_output,
)

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class HFReader(CheckpointReader):
    """A Hugging Face `LlamaForCausalLM` / `GPT2LMHeadModel` directory: config.json plus safetensors.

    Opening checks everything that can be checked without reading weights: every tensor the model needs
    is present, none is left over, and each has the shape config.json implies.
    """

    def __init__(self, load_dir: str):
        config_path = os.path.join(load_dir, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"{load_dir}: no config.json (not a Hugging Face model directory)")
        with open(config_path) as f:
            self.hf_config = json.load(f)
        config = config_from_hf(_load_hf_config(load_dir))
        self._maps = {m.name: m for m in tensor_maps(config)}
        self._location = self._index(load_dir, config)  # canonical HF name -> (file, name as stored)
        self._handles: dict[str, Any] = {}
        self._check(config, load_dir)
        first = next(iter(self._maps.values())).hf_names[0]
        dtype = _SAFETENSORS_DTYPES.get(self._handle(first).get_slice(self._location[first][1]).get_dtype(),
                                        torch.float32)
        self.config = dataclasses.replace(config, params_dtype=dtype)
        self.tokenizer_dir = load_dir if has_tokenizer(load_dir) else None

    def _index(self, load_dir: str, config: TransformerConfig) -> dict[str, tuple[str, str]]:
        index_path = os.path.join(load_dir, "model.safetensors.index.json")
        single = os.path.join(load_dir, "model.safetensors")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                stored = {name: os.path.join(load_dir, file) for name, file in json.load(f)["weight_map"].items()}
        elif os.path.isfile(single):
            stored = {name: single for name in safe_open(single, framework="pt").keys()}
        elif any(name.startswith("pytorch_model") for name in os.listdir(load_dir)):
            raise CheckpointError(f"{load_dir} holds pytorch_model*.bin (pickle) weights; only safetensors are read: "
                                  "re-save the model with save_pretrained(..., safe_serialization=True)")
        else:
            raise CheckpointError(f"{load_dir}: no model.safetensors or model.safetensors.index.json")
        return {canonical_hf_name(name, config): (file, name) for name, file in stored.items()}

    def _check(self, config: TransformerConfig, load_dir: str) -> None:
        needed = {name for m in self._maps.values() for name in m.hf_names}
        missing = sorted(needed - set(self._location))
        if missing:
            raise CheckpointError(f"{load_dir} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}")
        extra = sorted(n for n in set(self._location) - needed if not is_ignored_hf_name(n, config))
        if extra:
            raise CheckpointError(f"{load_dir} holds {len(extra)} tensor(s) this {_config_summary(config)} model "
                                  f"has no place for, e.g. {extra[:3]}; does config.json describe these weights?")
        for name, param in model_parameters(config).items():
            tensor_map = self._maps[name]
            expected = tensor_map.to_hf(torch.empty(param.shape, device="meta"), config)
            for hf_name, want in zip(tensor_map.hf_names, expected):
                have = tuple(self._handle(hf_name).get_slice(self._location[hf_name][1]).get_shape())
                if have != tuple(want.shape):
                    fields = ", ".join(f"{k}={self.hf_config.get(k)}" for k in tensor_map.hf_fields)
                    raise CheckpointError(f"{hf_name} has shape {list(have)}, but config.json ({fields}) implies "
                                          f"{list(want.shape)}")

    def _handle(self, hf_name: str) -> Any:
        """The open safetensors file holding `hf_name` (opening maps it; nothing is read yet)."""
        file = self._location[hf_name][0]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def tensor(self, name: str) -> torch.Tensor:
        tensor_map = self._maps[name]
        parts = [self._handle(n).get_tensor(self._location[n][1]) for n in tensor_map.hf_names]
        return tensor_map.to_ours(parts, self.config)

    def close(self) -> None:
        self._handles.clear()


def _load_hf_config(load_dir: str) -> Any:
    # Never look a directory name up on a model hub (it would stall without a network).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(load_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{load_dir}/config.json cannot be read by transformers: {exc}") from None


def _config_summary(config: TransformerConfig) -> str:
    return (f"{config.num_layers}-layer, hidden {config.hidden_size}, {config.num_attention_heads} heads "
            f"({config.query_groups} query groups)")


def write_hf(
    reader: CheckpointReader,
    config: TransformerConfig,
    save_dir: str,
    *,
    dtype: Optional[torch.dtype] = None,
    tokenizer_dir: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> list[str]:
    """Write `reader`'s weights as a Hugging Face model directory; returns the safetensors file names.

    Shards hold at most `max_shard_bytes` each (a larger single tensor gets a shard of its own); one
    shard is `model.safetensors`, several are `model-0000K-of-0000N.safetensors` with an index, as
    `save_pretrained` writes them. Vocabulary padding rows are dropped.
    """
    maps = tensor_maps(config)
    params = model_parameters(config)
    with staged_output(save_dir) as staging:
        parts: list[str] = []
        weight_map: dict[str, str] = {}
        current: dict[str, torch.Tensor] = {}
        current_bytes = total_bytes = 0
        written_dtype = dtype

        def flush() -> None:
            nonlocal current, current_bytes
            part = f"part-{len(parts):05d}.safetensors"
            save_file(current, os.path.join(staging, part), metadata={"format": "pt"})
            parts.append(part)
            weight_map.update({name: part for name in current})
            current, current_bytes = {}, 0

        with tqdm(total=len(maps), desc="safetensors", unit="tensor", disable=not progress) as bar:
            for tensor_map in maps:
                full = full_tensor(reader, tensor_map.name, params[tensor_map.name].shape, config.vocab_size)
                for hf_name, tensor in zip(tensor_map.hf_names, tensor_map.to_hf(full, config)):
                    tensor = compact(tensor, dtype)
                    written_dtype = written_dtype or tensor.dtype
                    size = tensor.numel() * tensor.element_size()
                    if current and current_bytes + size > max_shard_bytes:
                        flush()
                    current[hf_name] = tensor
                    current_bytes += size
                    total_bytes += size
                del full  # before the next read, so two full tensors never coexist
                bar.update()
        flush()
        names = (["model.safetensors"] if len(parts) == 1 else
                 [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))])
        for part, name in zip(parts, names):
            os.rename(os.path.join(staging, part), os.path.join(staging, name))
        if len(parts) > 1:
            renamed = dict(zip(parts, names))
            write_json(os.path.join(staging, "model.safetensors.index.json"), {
                "metadata": {"total_size": total_bytes},
                "weight_map": {name: renamed[part] for name, part in sorted(weight_map.items())},
            })
        hf_config_from(config, reader.hf_config, written_dtype).to_json_file(os.path.join(staging, "config.json"))
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, staging)
    return names
