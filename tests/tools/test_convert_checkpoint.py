"""Checkpoint conversion end to end on tiny models built with `transformers`: Hugging Face -> megatron_pp
(tp, pp, virtual stages, uneven) -> Hugging Face bit-identical, our model on converted shards gives
transformers' logits, resharding chains keep every weight, refusals in one line with nothing written,
Megatron-LM `model_optim_rng.pt` import under weights_only, the CLI, and fine-tuning a converted model."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import io
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron_pp.models.config import TransformerConfig  # noqa: E402
from megatron_pp.models.layout import StageSpec, split_layers  # noqa: E402
from megatron_pp.models.presets import get_preset  # noqa: E402
from megatron_pp.models.transformer import StageModel, build_model, full_named_parameters  # noqa: E402
from megatron_pp.core.tensor_parallel import shard_tensor  # noqa: E402
from megatron_pp.training.checkpointing import CheckpointError, iteration_dir, read_metadata  # noqa: E402
from megatron_pp.convert import (  # noqa: E402
    CheckpointReader,
    TargetLayout,
    config_from_json,
    convert_checkpoint,
    model_parameters,
    read_full_state,
    training_flags,
)
from tests.convert.megatron_lm_args import args_for  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_checkpoint as cli  # noqa: E402

TP2PP2 = TargetLayout(tp=2, pp=2)
SEQ = 32


# Tiny Hugging Face models -------------------------------------------------------------------------------


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every weight off its structured initial value (norms of one, zero biases) so that a mapping
    mistake in any of them shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)


def _write_tokenizer(directory, num_tokens: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(num_tokens)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0"}, f)


def _save_llama(directory, vocab_size: int, seed: int, layers: int = 4) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=176, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ, rope_theta=500000.0, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2,
    ))
    _perturb(model, seed)
    # Small shards: the reader must follow model.safetensors.index.json across files.
    model.save_pretrained(directory, max_shard_size="100KB")
    _write_tokenizer(directory, vocab_size - 10)


def _save_gpt2(directory, seed: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=4, n_head=4, n_positions=SEQ,
                                       bos_token_id=0, eos_token_id=0))
    _perturb(model, seed)
    model.save_pretrained(directory)
    _write_tokenizer(directory, 512)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """llama: GQA (8 heads, 4 groups), vocabulary 500 (padded to 512), several safetensors shards.
    gpt2: tied embeddings, learned positions, biases, vocabulary 512."""
    dirs = {"llama": str(tmp_path_factory.mktemp("llama-hf")), "gpt2": str(tmp_path_factory.mktemp("gpt2-hf"))}
    _save_llama(dirs["llama"], 500, seed=1)
    _save_gpt2(dirs["gpt2"], seed=2)
    return dirs


def _hf_model(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


def _tokens(vocab_size: int, b: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab_size, (b, SEQ), generator=torch.Generator().manual_seed(11))


def _hf_logits_and_loss(directory, tokens, labels):
    with torch.no_grad():
        logits = _hf_model(directory)(tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    return logits, loss


def _bytes(*path) -> bytes:
    with open(os.path.join(*path), "rb") as f:
        return f.read()


def _safetensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


# Our model on converted shards ----------------------------------------------------------------------------


def _stages_of(save_dir):
    directory = iteration_dir(save_dir, 0)
    metadata = read_metadata(directory)
    return config_from_json(metadata["model"]), [StageSpec(**s) for s in metadata["layout"]["stages"]]


def _run_all_stages(chunks, tokens, labels, tp_group):
    """Per-token loss and full logits `[b, s, V_padded]` of chunks run in order on one process."""
    import torch.distributed as dist

    captured = {}
    head = chunks[-1]
    hook = head.final_layernorm.register_forward_hook(lambda m, i, out: captured.setdefault("h", out))
    hidden = None
    with torch.no_grad():
        for chunk in chunks:
            hidden = chunk(hidden, {"tokens": tokens, "labels": labels})
    hook.remove()
    weight = head.output_layer.weight if head.output_layer is not None else head.embedding.word_embeddings.weight
    local = F.linear(captured["h"], weight)  # [s, b, V/tp]
    if tp_group is not None:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, local, group=tp_group)
        local = torch.cat(parts, dim=-1)
    return hidden, local.transpose(0, 1)


def _tp_forward(ctx, save_dir, tokens, labels):
    """Every global stage of the converted checkpoint, loaded through `load_checkpoint` on this tp rank."""
    from megatron_pp.training.checkpointing import TrainingState, load_checkpoint

    state = ctx.parallel_state(tp=2, pp=1)
    config, stages = _stages_of(save_dir)
    chunks = [StageModel(config, spec, tp_group=state.tp_group) for spec in stages]
    train = TrainingState(chunks=chunks, stage_ids=[s.stage for s in stages], stages=stages,
                          placement=[(0, c) for c in range(len(stages))], state=state, config=config,
                          schedule_name="converted")
    resumed = load_checkpoint(save_dir, train, finetune=True)
    assert resumed is not None and resumed.iteration == 0
    return _run_all_stages(chunks, tokens, labels, state.tp_group)


def _single_process_forward(save_dir, tokens, labels):
    config, stages = _stages_of(save_dir)
    (spec,) = stages
    model = StageModel(config, spec)
    shard = torch.load(os.path.join(iteration_dir(save_dir, 0), "model_stage000_tp00.pt"), weights_only=True)
    model.load_state_dict(shard["model"])
    return _run_all_stages([model], tokens, labels, None)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hf_to_tp2_pp2_gives_transformers_logits(hf_dirs, tmp_path, model):
    save = str(tmp_path / "tp2pp2")
    result = convert_checkpoint("hf", "megatron_pp", hf_dirs[model], save, layout=TP2PP2, progress=False)
    assert result.files == ["model_stage000_tp00.pt", "model_stage000_tp01.pt", "model_stage001_tp00.pt",
                            "model_stage001_tp01.pt"]
    metadata = read_metadata(iteration_dir(save, 0))
    assert metadata["layout"]["tp"] == 2 and metadata["layout"]["placement"] == [[0, 0], [1, 0]]
    assert [(s["layer_start"], s["layer_end"]) for s in metadata["layout"]["stages"]] == [(0, 2), (2, 4)]
    assert metadata["optimizer"]["saved"] is False
    for name in ("tokenizer.json", "tokenizer_config.json"):  # carried along, byte for byte
        assert _bytes(save, "tokenizer", name) == _bytes(hf_dirs[model], name)

    config = result.config
    tokens = _tokens(config.vocab_size)
    labels = torch.roll(tokens, -1, dims=1)
    expected_logits, expected_loss = _hf_logits_and_loss(hf_dirs[model], tokens, labels)
    loss, logits = run_distributed(2, _tp_forward, save, tokens, labels)[0]
    torch.testing.assert_close(logits[..., : config.vocab_size], expected_logits, rtol=1e-5, atol=1e-5)
    # Padding rows are zero, so their logits are too (llama: 500 tokens padded to 512).
    assert logits.shape[-1] == 512 and torch.count_nonzero(logits[..., config.vocab_size:]) == 0
    if config.vocab_size == logits.shape[-1]:
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_round_trip_to_hf_is_bit_identical(hf_dirs, tmp_path, model):
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    layout = TargetLayout(tp=2, pp=2, vp=2) if model == "llama" else TP2PP2
    convert_checkpoint("hf", "megatron_pp", hf_dirs[model], ours, layout=layout, progress=False)
    result = convert_checkpoint("megatron_pp", "hf", ours, back, max_shard_bytes=300_000, progress=False)
    assert len(result.files) > 1 and os.path.isfile(os.path.join(back, "model.safetensors.index.json"))

    original, converted = _safetensors(hf_dirs[model]), _safetensors(back)
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    with open(os.path.join(back, "config.json")) as f, open(os.path.join(hf_dirs[model], "config.json")) as g:
        written, source = json.load(f), json.load(g)
    for key in ("model_type", "vocab_size", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert written.get(key) == source.get(key), key
    assert _bytes(back, "tokenizer.json") == _bytes(hf_dirs[model], "tokenizer.json")

    tokens = _tokens(original[next(n for n in original if "wte" in n or "embed_tokens" in n)].shape[0])
    with torch.no_grad():
        assert torch.equal(_hf_model(back)(tokens).logits, _hf_model(hf_dirs[model])(tokens).logits)


def test_resharding_keeps_every_weight_and_the_logits(hf_dirs, tmp_path):
    """tp2pp2 -> tp1pp4 -> tp1pp1 -> tp2pp1vp2 -> uneven pp2 -> tp4 with a layer slot for the head."""
    source = str(tmp_path / "0")
    convert_checkpoint("hf", "megatron_pp", hf_dirs["llama"], source, layout=TP2PP2, progress=False)
    reference = dict(read_full_state(source))
    chain = [TargetLayout(tp=1, pp=4), TargetLayout(), TargetLayout(tp=2, pp=1, vp=2),
             TargetLayout(pp=2, first_stage_layers=1), TargetLayout(tp=4, pp=5, account_for_loss=True)]
    splits = [[(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 4)],
              [(0, 1), (1, 2), (2, 3), (3, 4), (4, 4)]]
    previous = source
    for step, (layout, split) in enumerate(zip(chain, splits), start=1):
        target = str(tmp_path / str(step))
        result = convert_checkpoint("megatron_pp", "megatron_pp", previous, target, layout=layout, progress=False)
        assert [(s.layer_start, s.layer_end) for s in result.stages] == split
        state = dict(read_full_state(target))
        assert state.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(state[name], tensor), (step, name)
        if layout == TargetLayout():
            tokens = _tokens(500)
            labels = torch.roll(tokens, -1, dims=1)
            expected, _ = _hf_logits_and_loss(hf_dirs["llama"], tokens, labels)
            _, logits = _single_process_forward(target, tokens, labels)
            torch.testing.assert_close(logits[..., :500], expected, rtol=1e-5, atol=1e-5)
        previous = target


def test_tied_gpt2_keeps_the_head_copy_through_resharding(hf_dirs, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    convert_checkpoint("hf", "megatron_pp", hf_dirs["gpt2"], a, layout=TargetLayout(pp=2), progress=False)
    # The head stage stores its own copy of the tied word embedding, equal to the first stage's.
    first, last = (torch.load(os.path.join(iteration_dir(a, 0), f"model_stage00{s}_tp00.pt"),
                              weights_only=True)["model"] for s in (0, 1))
    assert torch.equal(first["embedding.word_embeddings.weight"], last["embedding.word_embeddings.weight"])
    assert "embedding.position_embeddings.weight" not in last and "output_layer.weight" not in last
    convert_checkpoint("megatron_pp", "megatron_pp", a, b, progress=False)
    assert all(torch.equal(x[1], y[1]) for x, y in zip(read_full_state(a), read_full_state(b)))


def test_gpt2_file_without_prefix_and_with_mask_buffers(hf_dirs, tmp_path):
    """The original GPT-2 release names tensors without `transformer.` and stores causal-mask buffers."""
    from safetensors.torch import save_file

    bare = tmp_path / "bare"
    bare.mkdir()
    tensors = {name.removeprefix("transformer."): t for name, t in _safetensors(hf_dirs["gpt2"]).items()}
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, SEQ, SEQ))
    save_file(tensors, str(bare / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dirs["gpt2"], "config.json")) as f:
        (bare / "config.json").write_text(f.read())
    convert_checkpoint("hf", "megatron_pp", str(bare), str(tmp_path / "a"), progress=False)
    convert_checkpoint("hf", "megatron_pp", hf_dirs["gpt2"], str(tmp_path / "b"), progress=False)
    assert all(torch.equal(x[1], y[1]) for x, y in zip(read_full_state(str(tmp_path / "a")),
                                                       read_full_state(str(tmp_path / "b"))))


def test_true_vocab_size_drops_unused_embedding_rows(hf_dirs, tmp_path):
    save = str(tmp_path / "490")
    result = convert_checkpoint("hf", "megatron_pp", hf_dirs["llama"], save, true_vocab_size=490, progress=False)
    assert result.config.vocab_size == 490
    original = _safetensors(hf_dirs["llama"])
    state = dict(read_full_state(save))
    assert torch.equal(state["embedding.word_embeddings.weight"], original["model.embed_tokens.weight"][:490])
    assert torch.equal(state["output_layer.weight"], original["lm_head.weight"][:490])
    with pytest.raises(CheckpointError, match="--true-vocab-size 600 is larger than the checkpoint's vocabulary of 500"):
        convert_checkpoint("hf", "megatron_pp", hf_dirs["llama"], str(tmp_path / "600"), true_vocab_size=600,
                           progress=False)


def test_dtype_cast_and_vocab_padding_rule(hf_dirs, tmp_path):
    save = str(tmp_path / "bf16")
    result = convert_checkpoint("hf", "megatron_pp", hf_dirs["llama"], save, layout=TargetLayout(tp=2),
                                dtype=torch.bfloat16, make_vocab_size_divisible_by=10, progress=False)
    assert result.config.params_dtype == torch.bfloat16 and result.config.make_vocab_size_divisible_by == 10
    shard = torch.load(os.path.join(iteration_dir(save, 0), "model_stage000_tp00.pt"), weights_only=True)["model"]
    assert shard["embedding.word_embeddings.weight"].shape == (250, 64)  # 500 is a multiple of 10 * 2: no padding
    assert all(t.dtype == torch.bfloat16 for t in shard.values())
    assert _stages_of(save)[0].params_dtype == torch.bfloat16


# Refusals ------------------------------------------------------------------------------------------------


def _copy_hf(source, destination, config_changes=None, tokenizer_tokens=None):
    import shutil

    shutil.copytree(source, destination)
    if config_changes:
        path = os.path.join(destination, "config.json")
        with open(path) as f:
            values = json.load(f)
        values.update(config_changes)
        with open(path, "w") as f:
            json.dump(values, f)
    if tokenizer_tokens:
        _write_tokenizer(destination, tokenizer_tokens)
    return str(destination)


REFUSALS = {
    "kv-heads": ({"config_changes": {"num_key_value_heads": 2}}, {},
                 r"model.layers.0.self_attn.k_proj.weight has shape \[32, 64\], but config.json "
                 r"\(num_attention_heads=8, num_key_value_heads=2, head_dim=8, hidden_size=64\) implies \[16, 64\]"),
    "heads": ({"config_changes": {"num_attention_heads": 4}}, {},
              r"q_proj.weight has shape \[64, 64\], but config.json \(num_attention_heads=4"),
    "tp": ({}, {"layout": TargetLayout(tp=3)},
           "--num-attention-heads 8 is not divisible by --target-tensor-parallel-size 3"),
    "pp": ({}, {"layout": TargetLayout(pp=3)},
           "--num-layers 4 is not divisible by 3 pipeline stages .*--target-pipeline-parallel-size"),
    "tokenizer": ({"tokenizer_tokens": 600}, {},
                  "produces ids up to 599, but the model's vocabulary has only 500 rows"),
    "rope-scaling": ({"config_changes": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
                     {}, "RoPE scaling 'linear' is not implemented"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_mismatched_checkpoints_are_refused_and_nothing_is_written(hf_dirs, tmp_path, case):
    copy_options, convert_options, message = REFUSALS[case]
    source = _copy_hf(hf_dirs["llama"], tmp_path / "src", **copy_options)
    save = tmp_path / "out"
    with pytest.raises(ValueError, match=message) as err:
        convert_checkpoint("hf", "megatron_pp", source, str(save), progress=False, **convert_options)
    assert "\n" not in str(err.value)
    assert not save.exists() and sorted(os.listdir(tmp_path)) == ["src"]


def test_output_directory_must_be_new_or_empty(hf_dirs, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        convert_checkpoint("hf", "megatron_pp", hf_dirs["gpt2"], str(tmp_path / "taken"), progress=False)
    (tmp_path / "empty").mkdir()
    convert_checkpoint("hf", "hf", hf_dirs["gpt2"], str(tmp_path / "empty"), progress=False)
    assert os.path.isfile(tmp_path / "empty" / "model.safetensors")


def test_pickle_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 4}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="only safetensors are read"):
        convert_checkpoint("hf", "megatron_pp", str(tmp_path), str(tmp_path / "out"), progress=False)


# Megatron-LM ---------------------------------------------------------------------------------------------


class FakeAttnBackend(enum.Enum):
    """Pickled under Megatron-Core's name, as the `attention_backend` in a real checkpoint's args."""

    auto = 5


@contextlib.contextmanager
def _megatron_enum_module():
    """Make `megatron.core.transformer.enums.AttnBackend` importable while saving, then remove it again,
    so loading must work without any Megatron code."""
    names = ["megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums"]
    modules = {name: types.ModuleType(name) for name in names}
    modules[names[-1]].AttnBackend = FakeAttnBackend
    saved = (FakeAttnBackend.__module__, FakeAttnBackend.__qualname__)
    FakeAttnBackend.__module__, FakeAttnBackend.__qualname__ = names[-1], "AttnBackend"
    # The real megatron-core may be installed (a test dependency) and imported: put its modules back after.
    previous = {name: sys.modules[name] for name in names if name in sys.modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in names:
            del sys.modules[name]
        sys.modules.update(previous)
        FakeAttnBackend.__module__, FakeAttnBackend.__qualname__ = saved


def _megatron_args(config: TransformerConfig, tp: int, pp: int, vp: int, **extra) -> argparse.Namespace:
    """What Megatron-LM saves for a run of `config` (every field it did not set at Megatron-LM's default:
    tests/convert/megatron_lm_args.py), with its attention-backend enum, which must load without Megatron."""
    args = args_for(config, tp=tp, pp=pp, vp=vp, **extra)
    args.attention_backend = FakeAttnBackend.auto
    return args


def _half_to_interleaved(fused, config):
    """Inverse of the RoPE permutation the importer applies, written out per row: our rotate-half row i
    of a q or k head is interleaved row 2i, row i + d/2 is interleaved row 2i + 1."""
    d = config.head_dim
    per_group = config.num_attention_heads // config.query_groups
    out = fused.clone()
    for head in range(config.query_groups * (per_group + 2)):
        if head % (per_group + 2) == per_group + 1:
            continue  # value head
        for i in range(d // 2):
            out[head * d + 2 * i] = fused[head * d + i]
            out[head * d + 2 * i + 1] = fused[head * d + d // 2 + i]
    return out


# Where each of our parameters lives in Megatron-LM's two module trees; (dim, stride) of its TP split.
_MCORE_LAYER = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias": "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias": "self_attention.linear_proj.bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias": "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
}
_LEGACY_LAYER = {
    "input_layernorm": "input_norm", "self_attention.linear_qkv": "self_attention.query_key_value",
    "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_norm",
    "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h",
}


def _split(name: str, tensor: torch.Tensor, config: TransformerConfig, tp: int, rank: int) -> torch.Tensor:
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return shard_tensor(tensor, 1, 1, rank, tp)
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return shard_tensor(tensor, 0, 1, rank, tp)
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return shard_tensor(tensor, 0, 2 if config.activation == "swiglu" else 1, rank, tp)
    return tensor.clone()


def _write_megatron_lm(root, full, config, *, tp, pp, vp, style, iteration, args):
    """A Megatron-LM torch-format checkpoint of `full` (our global names): mcore (flat, TransformerEngine
    names, `_extra_state` entries) or legacy (nested `language_model` dicts, `word_embeddings_for_head`)."""
    stages = split_layers(config.num_layers, pp, vp)
    directory = os.path.join(root, "release" if iteration is None else f"iter_{iteration:07d}")
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release" if iteration is None else str(iteration))
    tied = not config.untie_embeddings_and_output_weights
    for t in range(tp):
        for p in range(pp):
            chunks = {}
            for c in range(vp):
                spec = stages[c * pp + p]
                piece = lambda name: _split(name, full[name], config, tp, t)  # noqa: E731
                if style == "mcore":
                    model = {}
                    if spec.has_embedding:
                        model["embedding.word_embeddings.weight"] = piece("embedding.word_embeddings.weight")
                        if "embedding.position_embeddings.weight" in full:
                            model["embedding.position_embeddings.weight"] = piece("embedding.position_embeddings.weight")
                    for local, layer in enumerate(spec.layers):
                        for ours, theirs in _MCORE_LAYER.items():
                            if f"layers.{layer}.{ours}" in full:
                                model[f"decoder.layers.{local}.{theirs}"] = piece(f"layers.{layer}.{ours}")
                        model[f"decoder.layers.{local}.self_attention.linear_qkv._extra_state"] = io.BytesIO(b"fp8")
                        model[f"decoder.layers.{local}.mlp.linear_fc2._extra_state"] = None
                    if spec.has_head:
                        model["decoder.final_layernorm.weight"] = piece("final_layernorm.weight")
                        if "final_layernorm.bias" in full:
                            model["decoder.final_layernorm.bias"] = piece("final_layernorm.bias")
                        model["output_layer.weight"] = piece("output_layer.weight" if not tied
                                                             else "embedding.word_embeddings.weight")
                else:
                    language_model = {}
                    if spec.has_embedding:
                        language_model["embedding"] = {
                            "word_embeddings": {"weight": piece("embedding.word_embeddings.weight")},
                            "position_embeddings": {"weight": piece("embedding.position_embeddings.weight")},
                        }
                    encoder = {}
                    for local, layer in enumerate(spec.layers):
                        for ours, theirs in _LEGACY_LAYER.items():
                            for kind in ("weight", "bias"):
                                encoder[f"layers.{local}.{theirs}.{kind}"] = piece(f"layers.{layer}.{ours}.{kind}")
                    if spec.has_head:
                        for kind in ("weight", "bias"):
                            encoder[f"final_norm.{kind}"] = piece(f"final_layernorm.{kind}")
                    language_model["encoder"] = encoder
                    model = {"language_model": language_model}
                    if spec.has_head and not spec.has_embedding:
                        model["word_embeddings_for_head"] = {"weight": piece("embedding.word_embeddings.weight")}
                chunks["model" if vp == 1 else f"model{c}"] = model
            state = {
                "args": args, "checkpoint_version": 3.0, "iteration": iteration or 0, **chunks,
                "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 1e-4}]}},
                "opt_param_scheduler": {"num_steps": 40, "decay_style": "cosine"},
                "rng_state": [{"random_rng_state": (3, (1, 2), None), "np_rng_state": np.random.get_state(),
                               "torch_rng_state": torch.get_rng_state()}],
            }
            rank_dir = os.path.join(directory, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            os.makedirs(rank_dir)
            with _megatron_enum_module():
                torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))


MEGATRON_CASES = {
    "mcore-llama-tp2-pp2": dict(preset="llama-tiny", tp=2, pp=2, vp=1, style="mcore", interleaved=False),
    "mcore-llama-rotary-interleaved": dict(preset="llama-tiny", tp=1, pp=2, vp=1, style="mcore", interleaved=True),
    "legacy-gpt-tp2-pp2-vp2-release": dict(preset="gpt-tiny", tp=2, pp=2, vp=2, style="legacy", interleaved=False),
}


@pytest.mark.parametrize("case", sorted(MEGATRON_CASES))
def test_megatron_lm_checkpoint_imports_exactly(tmp_path, case):
    spec = MEGATRON_CASES[case]
    config = get_preset(spec["preset"])
    true_vocab = 500 if spec["style"] == "legacy" else None  # legacy GPT: 500 real tokens padded to 512
    if true_vocab:
        config = TransformerConfig(**{**config.__dict__, "vocab_size": true_vocab})
    model = build_model(config, seed=21)
    full = full_named_parameters([model])
    written = dict(full)
    if spec["interleaved"]:
        for name in [n for n in full if "linear_qkv" in n]:
            written[name] = _half_to_interleaved(full[name], config)
    root = tmp_path / "megatron"
    root.mkdir()
    args = _megatron_args(config, spec["tp"], spec["pp"], spec["vp"], rotary_interleaved=spec["interleaved"],
                          ckpt_format="torch", use_legacy_models=spec["style"] == "legacy")
    _write_megatron_lm(str(root), written, config, tp=spec["tp"], pp=spec["pp"], vp=spec["vp"], style=spec["style"],
                       iteration=None if "release" in case else 40, args=args)

    save = str(tmp_path / "ours")
    result = convert_checkpoint("megatron_lm", "megatron_pp", str(root), save, true_vocab_size=true_vocab,
                                layout=TargetLayout(tp=2), progress=False)
    assert result.config.vocab_size == config.vocab_size
    assert result.config.untie_embeddings_and_output_weights == config.untie_embeddings_and_output_weights
    imported = dict(read_full_state(save))
    assert imported.keys() == set(model_parameters(config))
    for name, tensor in full.items():
        vocabulary = name in ("embedding.word_embeddings.weight", "output_layer.weight")
        assert torch.equal(imported[name], tensor[: config.vocab_size] if vocabulary else tensor), name
    iteration = 0 if "release" in case else 40
    assert read_metadata(iteration_dir(save, iteration))["iteration"] == iteration


class _TensorsReader(CheckpointReader):
    """Given full tensors (our names) as a conversion source: how the matrix below writes torch_dist files."""

    def __init__(self, config: TransformerConfig, tensors: dict, iteration: int):
        self.config, self._tensors, self.iteration = config, tensors, iteration

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def _write_torch_dist_as_megatron_lm(root: str, written: dict, config: TransformerConfig, args, iteration: int):
    """A torch_dist checkpoint holding `written` (QKV rows as the run's RoPE lays them out) whose common.pt
    carries `args` as Megatron-LM saves them (not the fields our exporter writes)."""
    from megatron_pp.convert.torch_dist import COMMON_FILE, write_torch_dist

    write_torch_dist(_TensorsReader(config, written, iteration), config, root, TargetLayout(tp=2), progress=False)
    common_path = os.path.join(iteration_dir(root, iteration), COMMON_FILE)
    common = torch.load(common_path, weights_only=False)
    with _megatron_enum_module():
        torch.save({**common, "args": args}, common_path)


def _file_matrix() -> dict[str, dict]:
    """Every combination a user's Megatron-LM run can have that megatron_pp models: GPT (LayerNorm, GELU,
    learned positions) and LLaMA (RMSNorm, SwiGLU, RoPE) x multi-head or grouped-query attention x tied or
    untied x with or without linear biases x (RoPE only) rotary interleaved or not x torch or torch_dist:
    48 tiny files, each written with Megatron-LM's args for that run. The torch files rotate through
    tp/pp layouts (1x1, 2x1, 1x2, 2x2)."""
    cases, index = {}, 0
    for flavour in ("gpt", "llama"):
        for attention in ("mha", "gqa"):
            for tied in (True, False):
                for bias in (True, False):
                    for interleaved in ((False, True) if flavour == "llama" else (False,)):
                        for fmt in ("torch", "torch_dist"):
                            tp, pp = ((1, 1), (2, 1), (1, 2), (2, 2))[index % 4]
                            index += 1
                            name = "-".join([flavour, attention, "tied" if tied else "untied",
                                             "bias" if bias else "nobias"] + (["interleaved"] if interleaved else [])
                                            + [fmt] + ([f"tp{tp}pp{pp}"] if fmt == "torch" else []))
                            cases[name] = dict(flavour=flavour, gqa=attention == "gqa", tied=tied, bias=bias,
                                               interleaved=interleaved, fmt=fmt, tp=tp, pp=pp)
    return cases


FILE_MATRIX = _file_matrix()


@pytest.mark.parametrize("case", sorted(FILE_MATRIX))
def test_megatron_lm_files_as_megatron_lm_writes_them_import_exactly(tmp_path, case):
    """Each file imports to the very tensors that were saved (RoPE rows un-interleaved when the run used
    --rotary-interleaved, in either format), with the config the run had."""
    spec = FILE_MATRIX[case]
    base = get_preset("llama-tiny" if spec["flavour"] == "llama" else "gpt-tiny")
    config = dataclasses.replace(base, num_query_groups=2 if spec["gqa"] else None,
                                 untie_embeddings_and_output_weights=not spec["tied"],
                                 add_bias_linear=spec["bias"])
    model = build_model(config, seed=23)
    _perturb(model, 23)  # norms of one and zero biases would hide a mapping mistake in them
    full = full_named_parameters([model])
    written = dict(full)
    if spec["interleaved"]:
        for name in [n for n in full if "linear_qkv" in n]:
            written[name] = _half_to_interleaved(full[name], config)
        assert any(not torch.equal(written[n], full[n]) for n in written), "the permutation must move rows"
    root = tmp_path / "megatron"
    root.mkdir()
    args = _megatron_args(config, spec["tp"], spec["pp"], 1, rotary_interleaved=spec["interleaved"],
                          ckpt_format=spec["fmt"])
    if spec["fmt"] == "torch":
        _write_megatron_lm(str(root), written, config, tp=spec["tp"], pp=spec["pp"], vp=1, style="mcore",
                           iteration=40, args=args)
    else:
        _write_torch_dist_as_megatron_lm(str(root), written, config, args, 40)
    save = str(tmp_path / "ours")
    result = convert_checkpoint("megatron_lm" if spec["fmt"] == "torch" else "torch_dist", "megatron_pp", str(root),
                                save, progress=False)
    for field in ("num_query_groups", "untie_embeddings_and_output_weights", "add_bias_linear", "activation",
                  "normalization", "position_embedding_type", "ffn_size", "head_dim"):
        assert getattr(result.config, field) == getattr(config, field), field
    imported = dict(read_full_state(save))
    assert imported.keys() == set(model_parameters(config))
    for name, tensor in full.items():
        assert torch.equal(imported[name], tensor), name


@pytest.mark.parametrize("field,value,flag", [
    ("use_rope_scaling", True, "--use-rope-scaling"),
    ("rotary_seq_len_interpolation_factor", 4, "--rotary-seq-len-interpolation-factor"),
    ("window_size", (128, 0), "--window-size"),
    ("quick_geglu", True, "--quick-geglu"),
    ("num_experts", 8, "--num-experts"),
    ("softmax_type", "off-by-one", "--softmax-type off-by-one"),
    ("mtp_num_layers", 1, "--mtp-num-layers"),
])
def test_megatron_lm_runs_with_features_we_lack_are_refused_by_flag(field, value, flag):
    """A run that set one of these computes something our model does not: refused by its flag, never imported
    as a different model. At Megatron-LM's defaults (every other test here) they pass."""
    from megatron_pp.convert.megatron_lm import config_from_megatron_args

    config = get_preset("llama-tiny")
    config_from_megatron_args(_megatron_args(config, 1, 1, 1), 512)
    with pytest.raises(CheckpointError, match=f"uses {flag}"):
        config_from_megatron_args(_megatron_args(config, 1, 1, 1, **{field: value}), 512)


def test_apply_layernorm_1p_is_carried_both_ways(tmp_path):
    """--apply-layernorm-1p stores each norm's scale minus one: an import keeps that meaning (the config says
    so), and an export tells Megatron-LM (it once wrote False, a model with every norm scale off by one)."""
    from megatron_pp.convert.megatron_lm import config_from_megatron_args

    config = dataclasses.replace(get_preset("gpt-tiny"), apply_layernorm_1p=True)
    imported, _ = config_from_megatron_args(_megatron_args(config, 1, 1, 1, apply_layernorm_1p=True), 512)
    assert imported.apply_layernorm_1p
    assert not config_from_megatron_args(_megatron_args(config, 1, 1, 1), 512)[0].apply_layernorm_1p
    model = build_model(config, seed=3)
    root = tmp_path / "megatron"
    root.mkdir()
    _write_megatron_lm(str(root), full_named_parameters([model]), config, tp=1, pp=1, vp=1, style="mcore",
                       iteration=5, args=_megatron_args(config, 1, 1, 1, apply_layernorm_1p=True))
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    assert convert_checkpoint("megatron_lm", "megatron_pp", str(root), ours, progress=False).config.apply_layernorm_1p
    convert_checkpoint("megatron_pp", "megatron_lm", ours, back, progress=False)
    exported = torch.load(os.path.join(iteration_dir(back, 5), "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    assert exported["args"].apply_layernorm_1p is True


def test_megatron_lm_file_with_an_arbitrary_object_is_refused(tmp_path):
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    rank_dir = tmp_path / "ckpt" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    config = get_preset("gpt-tiny")
    torch.save({"args": _megatron_args(config, 1, 1, 1), "model": {}, "hook": Payload()},
               rank_dir / "model_optim_rng.pt")
    with pytest.raises(CheckpointError) as err:
        convert_checkpoint("megatron_lm", "megatron_pp", str(tmp_path / "ckpt"), str(tmp_path / "out"), progress=False)
    message = str(err.value)
    assert "refusing to unpickle posix.system" in message or "refusing to unpickle os.system" in message
    assert "\n" not in message and not marker.exists() and not (tmp_path / "out").exists()


def test_megatron_lm_unknown_parameters_are_refused(tmp_path):
    config = get_preset("llama-tiny")
    full = full_named_parameters([build_model(config, seed=3)])
    root = tmp_path / "m"
    root.mkdir()
    _write_megatron_lm(str(root), full, config, tp=1, pp=1, vp=1, style="mcore", iteration=5,
                       args=_megatron_args(config, 1, 1, 1))
    path = root / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    with _megatron_enum_module():
        state = torch.load(path, weights_only=False)
        state["model"]["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(8)
        torch.save(state, path)
    with pytest.raises(CheckpointError, match="q_layernorm.weight' is not part of a GPT or LLaMA model"):
        convert_checkpoint("megatron_lm", "megatron_pp", str(root), str(tmp_path / "out"), progress=False)


# Command line ----------------------------------------------------------------------------------------------


def test_cli_converts_and_prints_the_training_flags(hf_dirs, tmp_path):
    save = str(tmp_path / "cli")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--source-format", "hf",
         "--target-format", "megatron_pp", "--load-dir", hf_dirs["gpt2"], "--save-dir", save,
         "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "megatron_pp shards: 100%" in proc.stderr  # the progress bar
    assert "layers per global stage: [0-2, 2-4]" in proc.stdout
    assert f"--load {save} --finetune --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in proc.stdout
    assert "to continue this run" not in proc.stdout  # a Hugging Face source has no training position


@pytest.mark.parametrize("argv,message", [
    (["--target-tensor-parallel-size", "3"],
     "--num-attention-heads 4 is not divisible by --target-tensor-parallel-size 3"),
    (["--target-format", "onnx"], "argument --target-format: invalid choice: 'onnx'"),
    (["--max-shard-size", "lots"], "'lots' is not a size like 5GB"),
])
def test_cli_errors_are_one_line_with_status_2(hf_dirs, tmp_path, capsys, argv, message):
    base = {"--source-format": "hf", "--target-format": "megatron_pp", "--load-dir": hf_dirs["gpt2"],
            "--save-dir": str(tmp_path / "x")}
    for flag_, value in zip(argv[::2], argv[1::2]):
        base[flag_] = value
    assert cli.main([item for pair in base.items() for item in pair] + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_checkpoint.py: error: ") and message in err and err.count("\n") == 1


def test_parse_size():
    assert cli.parse_size("5GB") == 5 * 10**9 and cli.parse_size("2MiB") == 2 * 2**20 and cli.parse_size("123") == 123


def test_training_flags_rebuild_the_config():
    from megatron_pp.training.arguments import build_parser, model_config_from_args

    config = TransformerConfig(**{**get_preset("llama-tiny").__dict__, "kv_channels": 16, "rotary_base": 5e5})
    args = build_parser().parse_args(training_flags(config) + ["--mock-data"])
    assert model_config_from_args(args) == config
    # Megatron-LM's settings that are on/off flags or fractions here too (a converted 1p model's printed flags).
    megatron_style = dataclasses.replace(config, apply_layernorm_1p=True, rotary_percent=0.5)
    args = build_parser().parse_args(training_flags(megatron_style) + ["--mock-data"])
    assert model_config_from_args(args) == megatron_style


# Fine-tuning a converted model ----------------------------------------------------------------------------


def _finetune(ctx, argv, tp=2, pp=2):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    return pretrain(parse_args(argv), state=ctx.parallel_state(tp, pp))


def test_pretrain_finetunes_a_converted_checkpoint_and_exports_it(tmp_path):
    from megatron_pp.data.mock import mock_sample

    hf_dir, converted, trained, exported = (str(tmp_path / n) for n in ("hf", "tp2pp2", "trained", "exported"))
    os.makedirs(hf_dir)
    _save_llama(hf_dir, 512, seed=4)  # 512 tokens: no padding, so our loss is transformers' loss
    result = convert_checkpoint("hf", "megatron_pp", hf_dir, converted, layout=TP2PP2, progress=False)
    argv = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
            "--seed", "3", "--load", converted, "--finetune", "--save", trained, *TP2PP2.training_flags(),
            *training_flags(result.config)]
    rows = [r for r in run_distributed(4, _finetune, argv)[0] if "loss" in r]
    assert [r["iteration"] for r in rows] == [1, 2, 3]

    samples = torch.stack([mock_sample(3, i, SEQ, 512) for i in range(4)])
    _, loss = _hf_logits_and_loss(hf_dir, samples[:, :-1], samples[:, 1:])
    assert rows[0]["loss"] == pytest.approx(loss.mean().item(), rel=1e-5)  # the converted weights were loaded
    assert rows[-1]["loss"] < rows[0]["loss"]

    convert_checkpoint("megatron_pp", "hf", trained, exported, tokenizer_dir=hf_dir, progress=False)
    saved = dict(read_full_state(trained))
    exported_model, original = _hf_model(exported), _hf_model(hf_dir)
    assert torch.equal(exported_model.model.embed_tokens.weight, saved["embedding.word_embeddings.weight"])
    assert not torch.equal(exported_model.lm_head.weight, original.lm_head.weight)  # it trained
    assert os.path.isfile(os.path.join(exported, "tokenizer.json"))


def test_v_placement_and_its_uneven_split_load_into_a_zb_v_run(tmp_path):
    """zb-v at pp 2 puts stages 0 and 3 on rank 0: with --decoder-first-pipeline-num-layers 2 that rank's two
    layers go to stages 0 and 3 ([0-1, 1-3, 3-5, 5-6]), not to stages 0 and 2 as the interleaved placement
    would split them ([0-1, 1-3, 3-4, 4-6]), which the run refuses to load."""
    from megatron_pp.data.mock import mock_sample

    hf_dir, converted = str(tmp_path / "hf"), str(tmp_path / "zbv")
    os.makedirs(hf_dir)
    _save_llama(hf_dir, 512, seed=5, layers=6)
    layout = TargetLayout(pp=2, schedule="zb-v", first_stage_layers=2)
    result = convert_checkpoint("hf", "megatron_pp", hf_dir, converted, layout=layout, progress=False)
    assert [(s.layer_start, s.layer_end) for s in result.stages] == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert read_metadata(iteration_dir(converted, 0))["layout"]["placement"] == [[0, 0], [1, 0], [1, 1], [0, 1]]
    assert layout.training_flags()[4:6] == ["--pipeline-schedule", "zb-v"]
    argv = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
            "--seed", "3", "--load", converted, "--finetune", *layout.training_flags(), *training_flags(result.config)]
    rows = [r for rank in run_distributed(2, _finetune, argv, tp=1, pp=2) for r in rank if "loss" in r]
    samples = torch.stack([mock_sample(3, i, SEQ, 512) for i in range(8)])
    _, loss = _hf_logits_and_loss(hf_dir, samples[:, :-1], samples[:, 1:])
    assert rows and rows[0]["loss"] == pytest.approx(loss.mean().item(), rel=1e-5)


def test_megatron_lm_targets_refuse_the_v_placement(hf_dirs, tmp_path, capsys):
    for target in ("megatron_lm", "torch_dist"):
        with pytest.raises(CheckpointError, match="--target-pipeline-schedule zb-v does not place stage g on rank g mod p"):
            convert_checkpoint("hf", target, hf_dirs["llama"], str(tmp_path / target),
                               layout=TargetLayout(pp=2, schedule="zb-v"), progress=False)
        assert not os.path.exists(tmp_path / target)
    argv = ["--source-format", "hf", "--target-format", "megatron_pp", "--load-dir", hf_dirs["llama"],
            "--save-dir", str(tmp_path / "x"), "--target-pipeline-parallel-size", "2",
            "--target-pipeline-schedule", "zb-v", "--target-num-virtual-stages-per-pipeline-rank", "3", "--no-progress"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--target-pipeline-schedule zb-v places exactly 2 stages" in err, err
