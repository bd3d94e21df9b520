"""benchmarks/bench_mfu.py: a tiny CPU run writes a complete report in which our model and Hugging Face's
LlamaForCausalLM have the same parameters and the same first loss; on a GPU, the default shapes give an MFU."""
import dataclasses
import json
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron_pp.models.presets import get_preset  # noqa: E402
from megatron_pp.models.transformer import build_model  # noqa: E402
from megatron_pp.benchmarks.harness import (  # noqa: E402
    MFU_FORMAT,
    build_hf_llama,
    copy_weights_to_hf,
    parameter_counts,
)
from megatron_pp.training.flops import iteration_flops  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_mfu  # noqa: E402

REPORT_FIELDS = {"format", "command", "date", "device", "versions", "model", "attention", "attention_in_use", "rounds", "steps_per_round",
                 "warmup_steps", "parameters", "model_flops_per_step", "tokens_per_step", "first_step_loss", "ours",
                 "hf", "ratio_tokens_per_s", "targets"}
MODEL_FIELDS = {"name", "optimizer", "step_time_s", "tokens_per_s", "tflops", "mfu", "warmup_losses",
                "peak_memory_allocated_bytes"}
SPREAD_FIELDS = {"median", "min", "max", "per_round"}


def independent_hf_parameter_count(model: dict) -> int:
    """HF's LlamaForCausalLM built from the report's numbers alone (not through megatron_pp.models.hf)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=model["vocab_size"], hidden_size=model["hidden_size"], intermediate_size=model["ffn_hidden_size"],
        num_hidden_layers=model["num_layers"], num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_key_value_heads"], head_dim=model["head_dim"],
        rope_parameters={"rope_type": "default", "rope_theta": model["rope_theta"]}, rms_norm_eps=model["rms_norm_eps"],
        tie_word_embeddings=model["tied_embeddings"], max_position_embeddings=model["seq_length"],
    )
    return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_tiny_cpu_run_writes_a_complete_report(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, even on a GPU machine
    out = tmp_path / "mfu.json"
    argv = ["--scale", "tiny", "--layers", "2", "--rounds", "3", "--steps", "2", "--warmup", "2",
            "--micro-batch-size", "2", "--json", str(out)]
    assert bench_mfu.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report) == REPORT_FIELDS
    assert report["attention_in_use"] == report["attention"]  # each side ran the kernel the table names
    assert report["format"] == MFU_FORMAT and report["command"] == "python benchmarks/bench_mfu.py " + " ".join(argv)
    assert report["device"]["type"] == "cpu" and report["device"]["peak_tflops"] is None
    assert {"python", "torch", "transformers", "cuda", "flash_attn"} <= set(report["versions"])
    model = report["model"]
    shape = (model["num_layers"], model["seq_length"], model["micro_batch_size"], model["dtype"])
    assert shape == (2, 64, 2, "float32")
    assert (model["num_key_value_heads"], model["rope_theta"], model["tied_embeddings"]) == (4, 500000.0, False)
    assert report["attention"] == {"ours": "sdpa", "hf": "sdpa"}

    # Same architecture: our parameter count equals that of an HF model built independently from the
    # reported numbers (llama-tiny's vocabulary 512 needs no padding rows, so nothing to account for).
    params = report["parameters"]
    assert params["ours_vocab_padding"] == 0 and params["match"] is True
    assert params["ours"] == params["hf"] == params["config_formula"] == independent_hf_parameter_count(model)

    # Same weights and batch: the same first loss; with the same optimizer settings the next steps follow.
    first = report["first_step_loss"]
    assert first["ours"] == pytest.approx(first["hf"], rel=1e-6) and first["ours"] > 0
    assert report["ours"]["warmup_losses"] == pytest.approx(report["hf"]["warmup_losses"], rel=1e-5)

    config = dataclasses.replace(get_preset("llama-tiny"), num_layers=2, seq_length=64, max_position_embeddings=64)
    assert report["model_flops_per_step"] == iteration_flops(config, 2).model
    assert report["tokens_per_step"] == 2 * 64
    for key in ("ours", "hf"):
        r = report[key]
        assert set(r) == MODEL_FIELDS and set(r["step_time_s"]) == SPREAD_FIELDS
        times = r["step_time_s"]
        assert len(times["per_round"]) == 3 and 0 < times["min"] <= times["median"] <= times["max"]
        assert r["tokens_per_s"] == pytest.approx(128 / times["median"])
        assert r["tflops"] == pytest.approx(report["model_flops_per_step"] / times["median"] / 1e12)
        assert r["mfu"] is None and r["peak_memory_allocated_bytes"] is None
    ratio = report["ratio_tokens_per_s"]
    assert set(ratio) == SPREAD_FIELDS
    assert ratio["per_round"] == pytest.approx(
        [h / o for o, h in zip(report["ours"]["step_time_s"]["per_round"], report["hf"]["step_time_s"]["per_round"])])
    assert report["targets"] == {"mfu": 0.5, "mfu_met": None, "ratio": 1.2, "ratio_met": None}
    table = capsys.readouterr().out
    assert "megatron_pp" in table and "hf_llama" in table and "ours / HF tokens/s" in table


def test_padded_vocabulary_is_accounted_for():
    # 500 tokens pad to 512 rows in ours (embedding and untied output layer); HF keeps 500.
    config = dataclasses.replace(get_preset("llama-tiny"), num_layers=1, vocab_size=500, attention_backend="sdpa")
    ours = build_model(config, seed=3)
    hf = build_hf_llama(config, "sdpa", torch.device("cpu"))
    copy_weights_to_hf(ours, hf, config)
    counts = parameter_counts(ours, hf, config)
    assert counts["ours_vocab_padding"] == 12 * 64 * 2
    assert counts["ours"] - counts["hf"] == counts["ours_vocab_padding"] and counts["match"] is True
    torch.testing.assert_close(hf.lm_head.weight, ours.output_layer.weight[:500], rtol=0, atol=0)


def test_mismatched_hf_model_is_refused():
    config = dataclasses.replace(get_preset("llama-tiny"), num_layers=1, attention_backend="sdpa")
    hf = build_hf_llama(dataclasses.replace(config, ffn_hidden_size=64), "sdpa", torch.device("cpu"))
    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        copy_weights_to_hf(build_model(config, seed=3), hf, config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_shapes_on_gpu(tmp_path):
    out = tmp_path / "mfu.json"
    assert bench_mfu.main(["--rounds", "1", "--steps", "2", "--warmup", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    model = report["model"]
    shape = (model["preset"], model["num_layers"], model["seq_length"], model["dtype"])
    assert shape == ("llama3-8b", 4, 4096, "bfloat16")
    assert report["parameters"]["match"] is True
    assert report["first_step_loss"]["ours"] == pytest.approx(report["first_step_loss"]["hf"], rel=2e-2)
    if report["device"]["peak_tflops"] is None:
        pytest.skip(f"no known bf16 peak for {report['device']['name']}: MFU is not reported")
    assert report["ours"]["mfu"] > 0 and report["hf"]["mfu"] > 0


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_hf_baseline_runs_the_attention_it_was_asked_for(implementation):
    """Set on the config after construction, transformers ignores the choice; the constructor is honoured
    and the benchmark reads back what the model will dispatch to."""
    from megatron_pp.benchmarks.harness import hf_attention_in_use

    config = dataclasses.replace(get_preset("llama-tiny"), num_layers=1, attention_backend="sdpa")
    hf = build_hf_llama(config, implementation, torch.device("cpu"))
    assert hf_attention_in_use(hf) == implementation
