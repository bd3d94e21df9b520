"""--rotary-percent and --apply-layernorm-1p against megatron-core 0.16.1's GPTModel (local layer spec, CPU).

A tiny LLaMA-style model of ours with partial RoPE (half of each head rotated) and zero-centred norm scales
is exported to Megatron-LM's `torch` format; the export's args carry both settings; a GPTModel built with
that `rotary_percent` loads the file and gives our logits. Megatron-Core's local spec uses torch's norms,
which have no zero-centred scale (Megatron-LM applies 1 + w in apex's and TransformerEngine's norms), so
the GPTModel gets the stored weights plus one: what Megatron-LM's 1p norms apply. The export's stored
norm weights are ours unchanged (zero-centred, as Megatron-LM stores them).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_pp.convert import TargetLayout, convert_checkpoint
from megatron_pp.convert.megatron_lm import rank_directory
from megatron_pp.convert.megatron_pp import write_megatron_pp
from megatron_pp.core.local_world import WorkerPool
from megatron_pp.models.presets import get_preset
from megatron_pp.training.checkpointing import config_from_json, config_to_json, iteration_dir
from tests.convert.test_megatron_core import (ATOL, _mcore_logits, _mcore_model, _megatron_core_on_cpu, _ModelReader,
                                              _our_logits, _our_model, _tokens, result_iteration)


def _mcore_runs_export(ctx, root: str, config_json: dict, tokens: torch.Tensor):
    """A GPTModel with the export's rotary_percent loads the export (1p norms applied as 1 + w); its logits
    and the args the export recorded."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config = config_from_json(config_json)
    with _megatron_core_on_cpu(1):
        model = _mcore_model(config, 1)
        # GPTModel takes rotary_percent as a constructor argument; the helper builds it at 1.0.
        model.rotary_pos_emb = RotaryEmbedding(kv_channels=config.head_dim, rotary_percent=config.rotary_percent,
                                               rotary_base=int(config.rotary_base), use_cpu_initialization=True)
        directory = iteration_dir(root, result_iteration(root))
        saved = torch.load(os.path.join(directory, rank_directory(0, 0, 1), "model_optim_rng.pt"), weights_only=False)
        state = {name: tensor + 1 if name.endswith("layernorm.weight") else tensor
                 for name, tensor in saved["model"].items()}
        model.load_state_dict(state, strict=True)
        args = saved["args"]
        return _mcore_logits(model, config, tokens), (args.rotary_percent, args.apply_layernorm_1p)


@pytest.fixture(scope="module")
def mcore_run():
    pools: dict[int, WorkerPool] = {}

    def run(world_size: int, fn, *args):
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size)
        return pools[world_size].run(fn, *args, timeout=600)  # megatron-core's import is slow on a busy machine

    yield run
    for pool in pools.values():
        pool.close()


def test_partial_rotary_and_zero_centred_norms_give_megatron_cores_logits(mcore_run, tmp_path):
    config = dataclasses.replace(get_preset("llama-tiny"), vocab_size=500, seq_length=16, rotary_percent=0.5,
                                 apply_layernorm_1p=True)
    model = _our_model(config, seed=3)
    tokens = _tokens(config)
    expected = _our_logits(model, tokens)
    ours, export = str(tmp_path / "ours"), str(tmp_path / "torch")
    write_megatron_pp(_ModelReader(model, config), config, ours, TargetLayout(), progress=False)
    convert_checkpoint("megatron_pp", "megatron_lm", ours, export, transformer_impl="local", progress=False)
    logits, recorded = mcore_run(1, _mcore_runs_export, export, config_to_json(config), tokens)[0]
    assert recorded == (0.5, True)
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    # The same weights rotating the whole head, or scaled by w instead of 1 + w, are another model: the
    # comparison above can fail.
    for changed in (dict(rotary_percent=1.0), dict(apply_layernorm_1p=False)):
        other = build_fresh(dataclasses.replace(config, **changed))
        other.load_state_dict(model.state_dict())
        assert (_our_logits(other.eval(), tokens) - expected).abs().max() > 100 * ATOL


def test_zero_centred_norm_is_the_plain_norm_of_one_plus_the_weight():
    config = dataclasses.replace(get_preset("llama-tiny"), vocab_size=500, seq_length=16, apply_layernorm_1p=True)
    model = _our_model(config, seed=4)
    plain = _our_model(dataclasses.replace(config, apply_layernorm_1p=False), seed=4)
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            q.copy_(p + 1 if name.endswith("layernorm.weight") else p)
    tokens = _tokens(config)
    torch.testing.assert_close(_our_logits(model, tokens), _our_logits(plain, tokens), rtol=0, atol=1e-6)
    # Initialised at zero: a fresh 1p model's norms start as the plain model's ones.
    fresh = {n: p for n, p in build_fresh(config).named_parameters() if n.endswith("layernorm.weight")}
    assert fresh and all(torch.equal(p, torch.zeros_like(p)) for p in fresh.values())


def build_fresh(config):
    from megatron_pp.models.transformer import build_model

    return build_model(config, seed=1)


def test_hugging_face_maps_store_one_plus_the_weight_and_refuse_partial_rotary():
    from megatron_pp.models.hf import hf_architecture, tensor_maps

    config = dataclasses.replace(get_preset("llama-tiny"), apply_layernorm_1p=True)
    maps = {m.name: m for m in tensor_maps(config)}
    norms = [name for name in maps if name.endswith("layernorm.weight")]
    assert len(norms) == 2 * config.num_layers + 1 and all(maps[n].kind == "scale_1p" for n in norms)
    w = torch.tensor([0.0, 0.25, -0.5])
    assert torch.equal(maps[norms[0]].to_hf(w, config)[0], w + 1)
    assert torch.equal(maps[norms[0]].to_ours([w + 1], config), w)
    assert maps["embedding.word_embeddings.weight"].kind == "same"
    with pytest.raises(ValueError, match="rotary_percent=0.5"):
        hf_architecture(dataclasses.replace(config, rotary_percent=0.5))
