"""Megatron-LM's two checkpoint formats against the real Megatron-Core (megatron-core 0.16.1, CPU, gloo).

Export: a tiny LLaMA-style and GPT-style model of ours is written as Megatron-LM's `torch` format and
as Megatron-Core's `torch_dist` for tp 1 and tp 2; a Megatron-Core `GPTModel` (local layer spec) of the
same shape, run with that tensor-parallel size, loads the files strictly and gives our logits. Import:
a `GPTModel` saves both formats (its own `state_dict` / `dist_checkpointing.save`) at tp 1 and 2; we
convert them and give its logits. A pp 2 x 2 virtual-stage export runs as four chained GPTModel chunks.
Megatron-Core is imported only in gloo workers of this module's own
pools (closed at its end, so its global state never meets another test), with three of its CUDA
assumptions patched for the duration of each call (see `_megatron_core_on_cpu`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os

import pytest
import torch
import torch.nn.functional as F

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import split_layers
from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import StageModel, build_model
from megatron_pp.training.checkpointing import config_from_json, config_to_json, iteration_dir
from megatron_pp.convert import (
    CheckpointReader,
    TargetLayout,
    convert_checkpoint,
    read_full_state,
)
from megatron_pp.convert.megatron_lm import rank_directory
from megatron_pp.convert.megatron_pp import write_megatron_pp
from megatron_pp.convert.torch_dist import MCORE_VERSION_CHECKED
from megatron_pp.core.local_world import WorkerPool
from tests.convert.megatron_lm_args import args_for

SEQ = 16
ATOL = 2e-5  # fp32; the two implementations order some reductions differently


def _config(flavour: str) -> TransformerConfig:
    # 500 real tokens: padding rows exist at tp 1 (512) and tp 2 (512), and must be dropped on import.
    return dataclasses.replace(get_preset("llama-tiny" if flavour == "llama" else "gpt-tiny"), vocab_size=500,
                               seq_length=SEQ)


def _tokens(config: TransformerConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(5))


def test_megatron_core_is_the_checked_version():
    """The pinned test dependency (launch/setup.sh installs it), read without importing it here."""
    try:
        installed = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    assert installed == MCORE_VERSION_CHECKED, (
        f"megatron-core=={MCORE_VERSION_CHECKED} is a test dependency (found {installed}): run launch/setup.sh")


# Our side ---------------------------------------------------------------------------------------------------


class _ModelReader(CheckpointReader):
    """Our whole model (one stage) as a conversion source."""

    def __init__(self, model: StageModel, config: TransformerConfig):
        self.config, self._state = config, model.state_dict()

    def tensor(self, name: str) -> torch.Tensor:
        return self._state[name]


def _our_model(config: TransformerConfig, seed: int) -> StageModel:
    model = build_model(config, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms of one and zero biases would hide a mapping mistake in them
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)
    return model.eval()


def _our_logits(model: StageModel, tokens: torch.Tensor) -> torch.Tensor:
    captured = {}
    hook = model.final_layernorm.register_forward_hook(lambda m, i, out: captured.setdefault("h", out))
    with torch.no_grad():
        model(None, {"tokens": tokens, "labels": tokens})
        hook.remove()
        weight = model.output_layer.weight if model.output_layer is not None else model.embedding.word_embeddings.weight
        return F.linear(captured["h"], weight).transpose(0, 1)[..., : model.config.vocab_size]


def _imported_logits(source_format: str, directory: str, tokens: torch.Tensor, tmp_path) -> torch.Tensor:
    """Our model on a Megatron checkpoint after conversion (through a megatron_pp checkpoint, as a user does)."""
    ours = str(tmp_path / f"imported-{source_format}")
    result = convert_checkpoint(source_format, "megatron_pp", directory, ours, true_vocab_size=500, progress=False)
    model = StageModel(result.config, split_layers(result.config.num_layers, 1)[0])
    model.load_state_dict(torch.load(os.path.join(iteration_dir(ours, result_iteration(ours)), result.files[0]),
                                     weights_only=True)["model"])
    return _our_logits(model.eval(), tokens)


def result_iteration(root: str) -> int:
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


# Megatron-Core side (gloo workers) --------------------------------------------------------------------------


@contextlib.contextmanager
def _megatron_core_on_cpu(tp: int):
    """Megatron-Core's model-parallel state for a `tp`-rank world, with the CUDA calls it makes on a
    CPU-only run replaced: RoPE moves its frequencies to `torch.cuda.current_device()`, checkpoint staging
    calls `torch.cuda.synchronize()`, and attention enters the CUDA RNG tracker even with dropout 0."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    saved = (torch.cuda.current_device, torch.cuda.synchronize, mcore_random.CudaRNGStatesTracker.fork)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    try:
        if not parallel_state.model_parallel_is_initialized():
            # Kept for the life of the worker, which only this module's tests use (`mcore_run`).
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        assert parallel_state.get_tensor_model_parallel_world_size() == tp
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, mcore_random.CudaRNGStatesTracker.fork = saved


@contextlib.contextmanager
def _child_processes_allowed():
    """Megatron-Core's checkpoint writer forks writer processes and keeps a result queue in a spawned
    manager; a pool worker is a daemon process, which may not start children. For the duration of a save
    the worker is not a daemon, and the manager is ours, shut down afterwards, so no process outlives it."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    process = mp.current_process()
    daemon = process._config.get("daemon")
    process._config["daemon"] = False
    manager = mp.get_context("spawn").Manager()
    filesystem_async._results_queue = manager.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None
        manager.shutdown()
        process._config["daemon"] = daemon


def _mcore_model(config: TransformerConfig, tp: int, num_layers: int = None, pre_process: bool = True,
                 post_process: bool = True, rotary_interleaved: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig as McoreConfig
    from megatron.core.transformer.utils import openai_gelu

    swiglu = config.activation == "swiglu"
    mcore_config = McoreConfig(
        num_layers=num_layers or config.num_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_query_groups=config.query_groups, ffn_hidden_size=config.ffn_size, kv_channels=config.head_dim,
        normalization=config.normalization, layernorm_epsilon=config.norm_epsilon, gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else openai_gelu, add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float32,
        rotary_interleaved=rotary_interleaved,
    )
    return GPTModel(mcore_config, get_gpt_layer_local_spec(normalization=config.normalization),
                    vocab_size=config.padded_vocab_size(tp), max_sequence_length=config.num_positions,
                    position_embedding_type=config.position_embedding_type, rotary_base=int(config.rotary_base),
                    share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights,
                    parallel_output=False, pre_process=pre_process, post_process=post_process)


def _mcore_logits(model, config: TransformerConfig, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    causal = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return model.eval()(tokens, positions, attention_mask=causal)[..., : config.vocab_size]


def _mcore_loads(ctx, fmt: str, root: str, config_json: dict, tokens: torch.Tensor):
    """Rank `ctx.rank` of a tp = world-size GPTModel loads our export strictly; its logits."""
    config = config_from_json(config_json)
    tp = ctx.world_size
    with _megatron_core_on_cpu(tp):
        model = _mcore_model(config, tp)
        directory = iteration_dir(root, result_iteration(root))
        if fmt == "megatron_lm":
            state = torch.load(os.path.join(directory, rank_directory(ctx.rank, 0, 1), "model_optim_rng.pt"),
                               weights_only=False)
            assert state["checkpoint_version"] == 3.0 and state["args"].tensor_model_parallel_size == tp
            model.load_state_dict(state["model"], strict=True)
        else:
            from megatron.core import dist_checkpointing

            # As Megatron-LM's load_checkpoint asks: the model under "model", common.pt's entries beside it.
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
            assert loaded["checkpoint_version"] == 3.0 and loaded["args"].ckpt_format == "torch_dist"
            model.load_state_dict(loaded["model"], strict=True)
        return _mcore_logits(model, config, tokens)


def _mcore_pipeline(ctx, root: str, config_json: dict, pp: int, chunks: int, tokens: torch.Tensor):
    """Every model chunk of a pp x virtual-stage export as its own GPTModel (pre_process on the first
    global stage, post_process on the last), each loading its file's `model{c}` strictly, run in stage
    order with the hidden states handed on as a pipeline schedule would; the last stage's logits."""
    config = config_from_json(config_json)
    stages = split_layers(config.num_layers, pp, chunks)
    directory = iteration_dir(root, result_iteration(root))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    causal = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)[None, None]
    hidden = None
    with _megatron_core_on_cpu(1), torch.no_grad():
        for spec in stages:
            model = _mcore_model(config, 1, len(spec.layers), spec.has_embedding, spec.has_head).eval()
            state = torch.load(os.path.join(directory, rank_directory(0, spec.stage % pp, pp), "model_optim_rng.pt"),
                               weights_only=False)
            model.load_state_dict(state[f"model{spec.stage // pp}"], strict=True)
            if not spec.has_embedding:
                model.set_input_tensor(hidden)
            hidden = model(tokens if spec.has_embedding else None, positions, attention_mask=causal)
    return hidden[..., : config.vocab_size]


def _perturb_mcore(model, seed: int, rank: int) -> None:
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            # Shards of a split tensor differ per rank; replicated tensors (norms) stay equal across ranks.
            split = getattr(param, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(seed * 1000 + index * 10 + (rank if split else 0))
            param.add_(torch.randn(param.shape, generator=g) * 0.05)


def _mcore_saves(ctx, fmt: str, root: str, config_json: dict, tokens: torch.Tensor, seed: int,
                 rotary_interleaved: bool = False):
    """A tp = world-size GPTModel saves itself as Megatron-LM would (weights, and `args` with every field
    the run did not set at Megatron-LM's default); its logits."""
    import torch.distributed as dist

    config = config_from_json(config_json)
    tp = ctx.world_size
    with _megatron_core_on_cpu(tp):
        # Replicated parameters (position embeddings) are initialised from the CPU generator: the same
        # seed on every rank keeps them equal, as Megatron-LM's seeding does.
        torch.manual_seed(seed)
        model = _mcore_model(config, tp, rotary_interleaved=rotary_interleaved)
        _perturb_mcore(model, seed, ctx.rank)
        # Megatron-LM does not record the real vocabulary (args.vocab_size None): --true-vocab-size says it.
        args = args_for(config, tp=tp, ckpt_format=fmt, transformer_impl="local", rotary_interleaved=rotary_interleaved)
        directory = iteration_dir(root, 7)
        common = {"args": args, "checkpoint_version": 3.0, "iteration": 7}
        if fmt == "torch":
            rank_dir = os.path.join(directory, rank_directory(ctx.rank, 0, 1))
            os.makedirs(rank_dir, exist_ok=True)
            torch.save({**common, "model": model.state_dict()}, os.path.join(rank_dir, "model_optim_rng.pt"))
        else:
            from megatron.core import dist_checkpointing

            if ctx.rank == 0:
                os.makedirs(directory, exist_ok=True)
            dist.barrier()
            with _child_processes_allowed():
                dist_checkpointing.save({**common, "model": model.sharded_state_dict()}, directory)
        dist.barrier()
        if ctx.rank == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("7")
        return _mcore_logits(model, config, tokens)


# Tests ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcore_run():
    """`run(world_size, fn, *args)` on gloo workers reserved for this module, closed when it ends."""
    pools: dict[int, WorkerPool] = {}

    def run(world_size: int, fn, *args):
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size)
        return pools[world_size].run(fn, *args)

    yield run
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """Per flavour: our model saved as a megatron_pp checkpoint, and its logits."""
    made = {}
    for flavour, seed in (("llama", 1), ("gpt", 2)):
        config = _config(flavour)
        model = _our_model(config, seed)
        root = str(tmp_path_factory.mktemp(f"ours-{flavour}") / "ckpt")
        write_megatron_pp(_ModelReader(model, config), config, root, TargetLayout(), progress=False)
        made[flavour] = (root, config, _our_logits(model, _tokens(config)))
    return made


EXPORTS = [(flavour, fmt, tp) for flavour in ("llama", "gpt") for fmt in ("megatron_lm", "torch_dist") for tp in (1, 2)]


@pytest.mark.parametrize("flavour,fmt,tp", EXPORTS, ids=[f"{f}-{m}-tp{t}" for f, m, t in EXPORTS])
def test_megatron_core_loads_our_export_and_gives_our_logits(mcore_run, ours, tmp_path, flavour, fmt, tp):
    root, config, expected = ours[flavour]
    save = str(tmp_path / fmt)
    result = convert_checkpoint("megatron_pp", fmt, root, save, layout=TargetLayout(tp=tp), transformer_impl="local",
                                progress=False)
    assert result.config.vocab_size == 500
    logits = mcore_run(tp, _mcore_loads, fmt, save, config_to_json(config), _tokens(config))[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    # And back: the export imports to the very tensors it came from.
    back = dict(read_full_state(save, fmt))
    for name, tensor in read_full_state(root):
        assert torch.equal(back[name], tensor), name


# LLaMA-style: grouped-query, untied, no biases; GPT-style: multi-head (Megatron-LM's args then say
# num_query_groups 1 with group_query_attention False), tied, biases. RoPE interleaved in both formats.
IMPORTS = ([("llama", fmt, tp, False) for fmt in ("torch", "torch_dist") for tp in (1, 2)]
           + [("gpt", fmt, 2, False) for fmt in ("torch", "torch_dist")]
           + [("llama", fmt, 2, True) for fmt in ("torch", "torch_dist")])


@pytest.mark.parametrize("flavour,fmt,tp,interleaved", IMPORTS,
                         ids=[f"{f}-{m}-tp{t}" + ("-rotary-interleaved" if i else "") for f, m, t, i in IMPORTS])
def test_megatron_core_checkpoint_imports_with_its_logits(mcore_run, tmp_path, flavour, fmt, tp, interleaved):
    config = _config(flavour)
    tokens = _tokens(config)
    root = str(tmp_path / "mcore")
    os.makedirs(root)
    expected = mcore_run(tp, _mcore_saves, fmt, root, config_to_json(config), tokens, 3, interleaved)[0]
    source = "megatron_lm" if fmt == "torch" else "torch_dist"
    torch.testing.assert_close(_imported_logits(source, root, tokens, tmp_path), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("flavour", ["llama", "gpt"])
def test_megatron_core_runs_our_pipelined_export_chunk_by_chunk(mcore_run, ours, tmp_path, flavour):
    """pp 2 with 2 virtual stages: 4 GPTModel chunks (the GPT-style head holding the tied embedding's copy as
    output_layer.weight) load their `model0`/`model1` entries strictly and, chained, give our logits."""
    root, config, expected = ours[flavour]
    save = str(tmp_path / "pp2vp2")
    convert_checkpoint("megatron_pp", "megatron_lm", root, save, layout=TargetLayout(pp=2, vp=2),
                       transformer_impl="local", progress=False)
    logits = mcore_run(1, _mcore_pipeline, save, config_to_json(config), 2, 2, _tokens(config))[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)


def test_virtual_pipeline_export_round_trips(ours, tmp_path):
    """pp 2 with 2 virtual stages and an uneven first stage: `model0`/`model1` chunks with local layer numbers,
    read back to the same tensors (torch format) and through torch_dist."""
    root, config, _ = ours["llama"]
    layout = TargetLayout(tp=2, pp=2, vp=2)
    save = str(tmp_path / "vp")
    result = convert_checkpoint("megatron_pp", "megatron_lm", root, save, layout=layout, progress=False)
    assert result.files == [f"mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt" for t in range(2) for p in range(2)]
    state = torch.load(os.path.join(iteration_dir(save, 0), "mp_rank_01_001", "model_optim_rng.pt"), weights_only=False)
    assert sorted(k for k in state if k.startswith("model")) == ["model0", "model1"]
    assert state["args"].virtual_pipeline_model_parallel_size == 2
    # Pipeline rank 1 holds global stages 1 and 3: layers 1 and 3, each numbered 0 in its chunk.
    assert any(k.startswith("decoder.layers.0.") for k in state["model1"])
    assert not any(k.startswith("decoder.layers.1.") for k in state["model1"])
    assert "decoder.final_layernorm.weight" in state["model1"] and "output_layer.weight" in state["model1"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in state["model0"]  # TransformerEngine names
    reference = dict(read_full_state(root))
    dist_save = str(tmp_path / "dist")
    convert_checkpoint("megatron_lm", "torch_dist", save, dist_save, progress=False)
    for fmt, path in (("megatron_lm", save), ("torch_dist", dist_save)):
        for name, tensor in read_full_state(path, fmt):
            assert torch.equal(tensor, reference[name]), (fmt, name)


def test_torch_dist_model_keys_megatron_pp_lacks_are_refused(ours, tmp_path):
    """A torch_dist checkpoint with a model tensor we have no place for (here a MoE router) is refused by
    name, not silently dropped; optimizer and `_extra_state` entries are skipped."""
    from megatron_pp.core.dcp_files import ChunkToWrite, DcpIndex, write_dcp

    root, _, _ = ours["llama"]
    export = str(tmp_path / "export")
    convert_checkpoint("megatron_pp", "torch_dist", root, export, progress=False)
    source = DcpIndex(iteration_dir(export, 0))
    tampered = tmp_path / "tampered"
    directory = tampered / "iter_0000000"
    directory.mkdir(parents=True)
    for name in ("common.pt", "metadata.json"):
        (directory / name).write_bytes((tmp_path / "export" / "iter_0000000" / name).read_bytes())
    (tampered / "latest_checkpointed_iteration.txt").write_text("0")
    chunks = [ChunkToWrite(key, info.shape, (0,) * len(info.shape), info.shape, info.dtype, key)
              for key, info in source.keys.items() if info is not None]
    chunks.append(ChunkToWrite("decoder.layers.mlp.router.weight", (4, 8, 64), (0, 0, 0), (4, 8, 64), torch.float32,
                               None))

    def fetch(key):
        if key is None:
            return torch.zeros(4, 8, 64)
        shape = source.keys[key].shape
        return source.read(key, (0,) * len(shape), shape)

    write_dcp(str(directory), chunks, {}, fetch)
    with pytest.raises(ValueError, match="decoder.layers.mlp.router.weight is not part of a GPT or LLaMA model"):
        convert_checkpoint("torch_dist", "megatron_pp", str(tampered), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_exports_and_says_how_megatron_lm_loads_it(ours, tmp_path, capsys):
    import importlib.util as util

    spec = util.spec_from_file_location("convert_checkpoint_cli", os.path.join(
        os.path.dirname(__file__), "..", "..", "tools", "convert_checkpoint.py"))
    cli = util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    root, _, _ = ours["gpt"]
    save = str(tmp_path / "mlm")
    assert cli.main(["--source-format", "megatron_pp", "--target-format", "megatron_lm", "--load-dir", root,
                     "--save-dir", save, "--target-pipeline-parallel-size", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "layers per global stage: [0-2, 2-4]" in out
    assert f"--load {save} --use-checkpoint-args --finetune" in out and "--no-load-optim --no-load-rng" in out
    head = torch.load(os.path.join(iteration_dir(save, 0), "mp_rank_00_001", "model_optim_rng.pt"), weights_only=False)
    # GPT-style: tied embedding, so the head stage holds the copy as Megatron-Core's output_layer.weight.
    assert head["args"].openai_gelu and not head["args"].untie_embeddings_and_output_weights
    assert "output_layer.weight" in head["model"] and "embedding.word_embeddings.weight" not in head["model"]
