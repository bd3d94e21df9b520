"""Arguments: generated flags, YAML config files, validation of bad combinations, derived values, and
the exit path (status 2, one line per problem, no traceback, nothing written)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.schedules.registry import schedule_options
from megatron_pp.training.arguments import (
    ConfigFileError,
    build_parser,
    derive_args,
    expand_config_file,
    parse_args,
    validate_args,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "3"]


def errors_of(argv):
    return validate_args(build_parser().parse_args(argv))


def test_base_arguments_are_valid():
    assert errors_of(BASE) == []


def test_flags_are_generated_from_their_sources():
    parser = build_parser()
    options = {o for action in parser._actions for o in action.option_strings}
    skipped = {"add_bias_linear", "untie_embeddings_and_output_weights", "params_dtype"}
    assert {flag(f.name) for f in dataclasses.fields(TransformerConfig) if f.name not in skipped} <= options
    assert {o.flag for o in schedule_options()} <= options
    assert {"--data-path", "--split", "--tokenizer-type", "--vocab-file"} <= options  # from DataConfig


BAD = [
    (["--global-batch-size", "3", "--micro-batch-size", "2"], "--global-batch-size 3 is not divisible"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--train-samples", "64"], "exactly one of --train-iters and --train-samples"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive"),
    (["--loss-scale", "128"], "--loss-scale applies only to --fp16"),
    (["--min-loss-scale", "8", "--initial-loss-scale", "4"], "--min-loss-scale 8.0 is above --initial-loss-scale"),
    (["--hysteresis", "0"], "--hysteresis must be >= 1"),
    (["--loss-scale-window", "0"], "--loss-scale-window must be >= 1"),
    (["--lr", "0.01", "--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.01"),
    (["--lr", "-1"], "--lr must be >= 0"),
    (["--lr-warmup-iters", "5"], "--lr-warmup-iters 5 must be less than the decay length 3"),
    (["--lr-warmup-samples", "8"], "--lr-warmup-samples needs --train-samples"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-wsd-decay-style", "cosine"], "--lr-wsd-decay-style applies only to --lr-decay-style WSD"),
    (["--adam-beta2", "1.0"], "--adam-beta2 must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps must be > 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--recompute-method", "block"], "--recompute-method needs --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "--recompute-method applies to --recompute-granularity full, not selective"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--recompute-num-layers", "2"], "--recompute-num-layers needs --recompute-method"),
    (["--save-interval", "10"], "--save-interval needs --save"),
    (["--finetune"], "--finetune needs --load"),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint needs --load"),
    (["--exit-signal-handler"], "--exit-signal-handler needs --save"),
    (["--exit-interval", "0"], "--exit-interval must be >= 1"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0"),
    (["--eval-interval", "0"], "--eval-interval must be >= 1"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0"),
    (["--log-interval", "0"], "--log-interval must be >= 1"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0"),
    (["--wandb-exp-name", "run1"], "--wandb-exp-name needs --wandb-project"),
    (["--metrics-file", "/nonexistent-dir/m.jsonl"], "--metrics-file /nonexistent-dir/m.jsonl: directory"),
    (["--use-flash-attn", "--attention-backend", "sdpa"], "--use-flash-attn contradicts --attention-backend sdpa"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2: context parallelism is not implemented"),
    (["--fp8-format", "hybrid"], "--fp8-format: fp8 training needs TransformerEngine"),
    (["--tensor-model-parallel-size", "8"], "--tensor-model-parallel-size"),
    (["--data-path", "/nonexistent/corpus"], "--data-path: /nonexistent/corpus.bin: no such file"),
    (["--pipeline-schedule", "1f1b", "--microbatch-group-size-per-vp-stage", "4"],
     "--microbatch-group-size-per-vp-stage does not apply to --pipeline-schedule 1f1b"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"], "applies to --recompute-granularity full"),
    (["--pipeline-schedule", "2bw", "--use-distributed-optimizer"],
     "2bw keeps whole fp32 main weights and gradients per stage (weight versions): --use-distributed-optimizer is not supported"),
    (["--pipeline-schedule", "2bw", "--data-parallel-sharding-strategy", "optim"],
     "--data-parallel-sharding-strategy optim is not supported with it"),
]


def test_generated_flags_carry_their_field_docstring_as_help():
    # A generated flag's help is the attribute docstring under its TransformerConfig field: its own text,
    # not its neighbour's, and every generated flag has one.
    helps = {a.dest: a.help for a in build_parser()._actions}
    assert helps["num_layers"] == "Number of transformer layers."
    assert helps["hidden_size"] == "Width of the residual stream (h)."
    skipped = {"add_bias_linear", "untie_embeddings_and_output_weights", "params_dtype"}
    assert all(helps[f.name] for f in dataclasses.fields(TransformerConfig) if f.name not in skipped)


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_combination_is_reported_by_flag(extra, needle):
    errors = errors_of(BASE + extra)
    assert any(needle in e for e in errors), errors
    for line in errors:
        assert "\n" not in line and "--" in line, line


def test_world_size_can_be_given_instead_of_the_launchers():
    args = build_parser().parse_args(BASE + ["--tensor-model-parallel-size", "2", "--global-batch-size", "4"])
    assert validate_args(args, world_size=4) == []
    assert any("world size 3 is not divisible" in e for e in validate_args(args, world_size=3))


def test_every_problem_is_reported_at_once():
    errors = errors_of(BASE + ["--micro-batch-size", "0", "--hysteresis", "0", "--finetune", "--log-interval", "0"])
    assert len(errors) == 4, errors


def test_length_file_and_data_problems(tmp_path):
    assert any("exactly one of --train-iters and --train-samples" in e
               for e in errors_of(["--model-preset", "gpt-tiny", "--mock-data"]))
    assert any("--train-samples 2 is less than one --global-batch-size 4" in e
               for e in errors_of(["--model-preset", "gpt-tiny", "--mock-data", "--train-samples", "2",
                                   "--global-batch-size", "4"]))
    assert any("no data" in e for e in errors_of(["--model-preset", "gpt-tiny", "--train-iters", "3"]))
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    assert any(f"--save {a_file} is a file" in e for e in errors_of(BASE + ["--save", str(a_file)]))
    no_valid = errors_of(["--model-preset", "gpt-tiny", "--train-iters", "3", "--data-path", str(tmp_path / "c"),
                          "--split", "100,0,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                          "--eval-interval", "5"])
    assert any("--split 100,0,0 gives the validation split no documents" in e for e in no_valid), no_valid


def test_derived_values():
    args = derive_args(build_parser().parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--train-samples",
                                                  "70", "--micro-batch-size", "2", "--global-batch-size", "8"]),
                       world_size=1)
    assert args.train_iters == 8  # 70 // 8, Megatron's rounding down
    args = derive_args(build_parser().parse_args(BASE + ["--micro-batch-size", "3", "--pipeline-model-parallel-size",
                                                         "2"]), world_size=8)
    assert args.global_batch_size == 3 * 4  # micro-batch x dp


# Config files -----------------------------------------------------------------------------------------


def test_config_file_equals_the_command_line_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model-preset: llama-tiny\n"
        "mock_data: true\n"
        "train-iters: 5\n"
        "lr: 1e-4\n"                         # YAML 1.1 reads this as a string: argparse converts it
        "micro_batch_size: 2\n"
        "pipeline-schedule: gpipe\n"
        "disable-bias-linear: true\n"
        "sequence-parallel: false\n"
        "data-path: [0.3, a, 0.7, b]\n"
    )
    parser = build_parser()
    from_file = parser.parse_args(expand_config_file(parser, ["--config", str(config), "--train-iters", "7"]))
    direct = parser.parse_args(["--model-preset", "llama-tiny", "--mock-data", "--train-iters", "7", "--lr", "1e-4",
                                "--micro-batch-size", "2", "--pipeline-schedule", "gpipe", "--disable-bias-linear",
                                "--data-path", "0.3", "a", "0.7", "b", "--config", str(config)])
    assert vars(from_file) == vars(direct)
    assert from_file.train_iters == 7 and from_file.lr == 1e-4 and from_file.add_bias_linear is False


@pytest.mark.parametrize("text,needle", [
    ("lr: 0.1\nlearning-rate: 0.1\nbogus_key: 1\n", ["unknown key 'learning-rate' (there is no flag --learning-rate)",
                                                      "unknown key 'bogus_key'"]),
    ("- lr\n- 0.1\n", ["expected a mapping of flag names to values, got a list"]),
    ("lr: [0.1\n", ["not valid YAML at line"]),
    ("mock-data: 1\n", ["mock-data must be true or false"]),
    ("lr: [0.1, 0.2]\n", ["lr takes one value, got a list"]),
    ("config: other.yaml\n", ["unknown key 'config'"]),
    ("lr: {peak: 0.1}\n", ["lr takes a value, got a mapping"]),
])
def test_bad_config_files(tmp_path, text, needle):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ConfigFileError) as info:
        expand_config_file(build_parser(), ["--config", str(config)])
    assert len(info.value.lines) == len(needle)
    for line, expected in zip(info.value.lines, needle):
        assert line.startswith(f"--config {config}: ") and expected in line, line


def test_default_preset_applies_only_when_no_model_is_given(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model-preset: llama-tiny\nmock-data: true\ntrain-iters: 2\n")
    assert parse_args(["--config", str(config)], default_preset="gpt-tiny").model_preset == "llama-tiny"
    assert parse_args(["--mock-data", "--train-iters", "2"], default_preset="gpt-tiny").model_preset == "gpt-tiny"
    explicit = parse_args(["--mock-data", "--train-iters", "2", "--num-layers", "2", "--hidden-size", "64",
                           "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128"],
                          default_preset="gpt-tiny")
    assert explicit.model_preset is None


def test_config_file_errors_exit_2(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("bogus: 1\nalso-bogus: 2\n")
    with pytest.raises(SystemExit) as info:
        parse_args(["--config", str(config)])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"error: --config {config}: unknown key 'bogus' (there is no flag --bogus)",
                     f"error: --config {config}: unknown key 'also-bogus' (there is no flag --also-bogus)"]
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    assert "No such file" in capsys.readouterr().err


def test_bad_arguments_exit_2_before_anything_is_written(tmp_path):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--mock-data", "--train-iters", "3",
         "--save", str(save), "--metrics-file", str(metrics), "--save-interval", "0", "--hysteresis", "0",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "9", "--exit-signal-handler", "--peak-tflops", "-5"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 4 and all(line.startswith("error: --") for line in lines), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not save.exists() and not metrics.exists()


@pytest.mark.parametrize("script,world", [("gpt3_175b.sh", 192), ("llama_3_8b.sh", 32)])
def test_launch_examples_pass_validation(tmp_path, monkeypatch, script, world):
    """The example scripts' flags validate for their world size; the only complaints allowed are the
    features declared but not yet wired into the loop (none, once they are)."""
    import shlex

    for name in ("corpus.bin", "corpus.idx", "vocab.json", "merges.txt", "tokenizer.json"):
        (tmp_path / name).write_text("")
    env = {**os.environ, "DRY_RUN": "1", "DATA_PATH": str(tmp_path / "corpus"), "VOCAB_FILE": str(tmp_path / "vocab.json"),
           "MERGE_FILE": str(tmp_path / "merges.txt"), "TOKENIZER_MODEL": str(tmp_path / "tokenizer.json"),
           "CHECKPOINT_PATH": str(tmp_path / "ckpt")}
    printed = subprocess.run(["bash", os.path.join(ROOT, "launch", "examples", script)], capture_output=True,
                             text=True, env=env, timeout=60, check=True).stdout
    tokens = shlex.split(printed)
    flags = tokens[next(i for i, t in enumerate(tokens) if t.endswith(".py")) + 1:]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = build_parser().parse_args(flags)
    assert args.data_path == [str(tmp_path / "corpus")] and args.save == str(tmp_path / "ckpt")
    assert args.num_layers == {"gpt3_175b.sh": 96, "llama_3_8b.sh": 32}[script]
    assert validate_args(args, this_machine=False) == []  # they run on a cluster, not on this machine


def test_rope_fusion_needs_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert any("--apply-rope-fusion needs CUDA" in e for e in errors_of(BASE + ["--apply-rope-fusion"]))


@pytest.mark.parametrize("flag", ["--lr-warmup-iters", "--lr-decay-iters", "--lr-wsd-decay-iters"])
def test_iteration_lr_flags_are_refused_when_the_run_counts_samples(flag):
    # A run counted in samples builds its LR schedule from the *-samples flags: an *-iters one would be
    # dropped without a word, so it is refused by name.
    errors = errors_of(["--model-preset", "gpt-tiny", "--mock-data", "--train-samples", "64", flag, "4"])
    assert any(e.startswith(f"{flag} needs --train-iters (this run counts --train-samples") for e in errors), errors


FLASH_SPELLINGS = [["--attention-backend", "flash"], ["--use-flash-attn"]]


def _machine(monkeypatch, cuda: bool, flash_attn: bool) -> None:
    import torch

    from megatron_pp.models import attention

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(attention, "_flash_attn_module", lambda: object() if flash_attn else None)


@pytest.mark.parametrize("spelling", FLASH_SPELLINGS, ids=lambda s: s[0])
def test_flash_attention_is_refused_where_it_cannot_run(monkeypatch, spelling):
    flag_name = " ".join(spelling)
    for cuda, flash_attn, needle in ((False, True, "needs CUDA"), (False, False, "needs CUDA"),
                                     (True, False, "the flash-attn package does not import here")):
        _machine(monkeypatch, cuda, flash_attn)
        errors = errors_of(BASE + spelling + ["--bf16"])
        assert len(errors) == 1 and errors[0].startswith(flag_name) and needle in errors[0], (cuda, flash_attn, errors)
    # A configuration checked for other machines (a cluster's launch script, a plan) is not held to this one.
    assert validate_args(build_parser().parse_args(BASE + spelling + ["--bf16"]), this_machine=False) == []


@pytest.mark.parametrize("spelling", FLASH_SPELLINGS, ids=lambda s: s[0])
def test_flash_attention_is_accepted_on_a_gpu_with_flash_attn(monkeypatch, spelling):
    _machine(monkeypatch, cuda=True, flash_attn=True)
    assert errors_of(BASE + spelling + ["--bf16"]) == []
    assert errors_of(BASE + spelling + ["--fp16"]) == []
    # Its kernels take only half precision: an fp32 run would fail at its first forward.
    assert errors_of(BASE + spelling) == [f"{' '.join(spelling)} needs --bf16 or --fp16 "
                                          "(flash-attn kernels take only half-precision tensors)"]


def test_flash_attention_on_a_cpu_exits_2_before_the_model_is_built(monkeypatch, capsys):
    import megatron_pp.models.transformer as transformer

    _machine(monkeypatch, cuda=False, flash_attn=False)
    monkeypatch.setattr(transformer, "build_model", lambda *a, **k: pytest.fail("model built"))
    with pytest.raises(SystemExit) as info:
        parse_args(BASE + ["--attention-backend", "flash", "--bf16"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --attention-backend flash needs CUDA (flash-attn has no CPU kernels); "
        "use --attention-backend auto or sdpa"]


def test_argument_error_reads_as_its_lines():
    # Tools that call the parser directly let ArgumentError through: its message must be the lines.
    from megatron_pp.training.arguments import ArgumentError
    error = ArgumentError(["--a is bad", "--b is bad"])
    assert str(error) == "--a is bad; --b is bad" and error.lines == ["--a is bad", "--b is bad"]


def test_flags_read_only_at_run_time_parse():
    # Flags that validation never reads (the runtime does) still have to be declared and keep their value.
    args = build_parser().parse_args(BASE + ["--distributed-backend", "gloo", "--no-measure-offload-time",
                                             "--schedule-plugin", "some.module"])
    assert (args.distributed_backend, args.measure_offload_time, args.schedule_plugin) == ("gloo", False, ["some.module"])
    assert build_parser().parse_args(BASE).measure_offload_time is None
    with pytest.raises(Exception, match="--distributed-backend"):
        build_parser().parse_args(BASE + ["--distributed-backend", "mpi"])


def _doc_tables(text):
    """The flag-group table and the defaults table of docs/training.md's "Arguments" section."""
    section = text.split("## Arguments and config files", 1)[1].split("\n## ", 1)[0]
    groups, defaults = {}, {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("group", "flag", "---"):
            continue
        if cells[0].startswith("`--"):
            defaults[cells[0].strip("`")] = cells[1]
        else:
            groups[cells[0]] = [w.strip("`,") for w in cells[1].split() if w.startswith("`--")]
    return groups, defaults


def test_documented_flags_and_defaults_are_the_parsers():
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        groups, defaults = _doc_tables(f.read())
    parser = build_parser()
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    documented = [flag for flags in groups.values() for flag in flags]
    assert len(documented) > 60 and len(defaults) > 20
    assert [f for f in documented if f not in by_flag] == []
    for name, text in defaults.items():
        default = by_flag[name].default
        if isinstance(default, str):
            assert text == default, name
        elif default is None:  # derived after parsing: the table says from what
            assert not text[0].isdigit(), name
        else:
            assert float(text.split()[0]) == default, name
    # Every flag with a non-trivial default is in the table.
    in_table = {a.option_strings[0] for a in parser._actions
                if a.default not in (None, False, [], argparse.SUPPRESS) and a.option_strings}
    assert in_table <= set(defaults), sorted(in_table - set(defaults))


def test_config_file_false_switches_off_an_on_off_flag_that_has_a_no_form(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("measure-offload-time: false\nsequence-parallel: false\n")
    parser = build_parser()
    argv = expand_config_file(parser, ["--config", str(config)])
    assert "--no-measure-offload-time" in argv and "--sequence-parallel" not in argv
    assert parser.parse_args(BASE + argv).measure_offload_time is False
    error = ConfigFileError(["a", "b"])
    assert str(error) == "a; b" and error.lines == ["a", "b"]


def test_model_config_takes_precision_flash_and_the_tokenizers_vocabulary():
    import torch

    from megatron_pp.training.arguments import model_config_from_args
    parse = build_parser().parse_args
    assert model_config_from_args(parse(BASE)).params_dtype == torch.float32
    assert model_config_from_args(parse(BASE + ["--bf16"])).params_dtype == torch.bfloat16
    assert model_config_from_args(parse(BASE + ["--fp16"])).params_dtype == torch.float16
    assert model_config_from_args(parse(BASE + ["--use-flash-attn"])).attention_backend == "flash"
    assert model_config_from_args(parse(BASE + ["--vocab-size", "512"]), vocab_size=777).vocab_size == 777


@pytest.mark.parametrize("flag_name", ["--num-virtual-stages-per-pipeline-rank",
                                       "--num-layers-per-virtual-pipeline-stage"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_virtual_stage_counts_below_one_are_refused_naming_the_flag(flag_name, value):
    args = build_parser().parse_args(BASE + ["--pipeline-model-parallel-size", "2",
                                             "--pipeline-schedule", "interleaved-1f1b", flag_name, value])
    errors = validate_args(args, world_size=2)
    assert len(errors) == 1 and flag_name in errors[0], errors


@pytest.mark.parametrize("flag_name", ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"])
def test_a_parallel_size_of_zero_is_one_line_naming_the_flag(flag_name):
    errors = errors_of(BASE + [flag_name, "0"])
    assert errors and all(isinstance(e, str) for e in errors)
    assert any(e == f"{flag_name} must be >= 1, got 0" for e in errors), errors


SAMPLES_BASE = BASE[:-2] + ["--train-samples", "8", "--global-batch-size", "1"]


@pytest.mark.parametrize("argv, line", [
    (BASE + ["--lr-decay-iters", "-1", "--lr-warmup-iters", "2"], "--lr-decay-iters must be >= 0, got -1"),
    (BASE + ["--train-iters", "0", "--lr-warmup-iters", "1"], "--train-iters must be >= 1, got 0"),
    (SAMPLES_BASE + ["--train-samples", "0", "--lr-warmup-samples", "4"], "--train-samples must be >= 1, got 0"),
    (SAMPLES_BASE + ["--lr-decay-samples", "-1", "--lr-warmup-samples", "2"], "--lr-decay-samples must be >= 0, got -1"),
    (BASE + ["--lr", "-0.5"], "--lr must be >= 0.0, got -0.5"),
    (SAMPLES_BASE[:-2] + ["--train-samples", "0", "--global-batch-size", "4"], "--train-samples must be >= 1, got 0"),
    (SAMPLES_BASE[:-2] + ["--train-samples", "-1", "--global-batch-size", "4"], "--train-samples must be >= 1, got -1"),
    (SAMPLES_BASE[:-2] + ["--train-samples", "1", "--global-batch-size", "4"],
     "--train-samples 1 is less than one --global-batch-size 4: no iteration would run"),
    (BASE + ["--train-iters", "1", "--lr-warmup-iters", "1"],
     "--lr-warmup-iters 1 must be less than the decay length 1 (--lr-decay-iters, default --train-iters)"),
    (BASE + ["--micro-batch-size", "0", "--global-batch-size", "4"], "--micro-batch-size must be >= 1, got 0"),
])
def test_a_length_or_rate_below_its_minimum_is_one_line_not_two(argv, line):
    # A negative decay length or learning rate is its own problem; the warm-up and min-lr comparisons
    # that read it must not add a second line about the same value.
    assert errors_of(argv) == [line]


def test_wsd_decay_as_long_as_the_decay_is_accepted():
    assert errors_of(BASE + ["--train-iters", "10", "--lr-decay-style", "WSD", "--lr-decay-iters", "8",
                             "--lr-wsd-decay-iters", "8"]) == []
    assert errors_of(BASE + ["--train-iters", "10", "--lr-decay-style", "WSD", "--lr-decay-iters", "8",
                             "--lr-wsd-decay-iters", "9"]) == ["--lr-wsd-decay-iters 9 exceeds --lr-decay-iters 8"]


# Every numeric check at its boundary: the lowest (or highest) value accepted, and the first refused, which
# must be one line naming the flag. `extra` makes the flag applicable.
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "block"]
BOUNDARIES = [
    ("--micro-batch-size", "1", "0", []),
    ("--global-batch-size", "1", "0", []),
    ("--train-iters", "1", "0", []),
    ("--lr-warmup-iters", "0", "-1", []),
    ("--lr-decay-iters", "0", "-1", []),
    ("--lr", "0", "-0.001", []),
    ("--min-lr", "0", "-0.001", []),
    ("--adam-beta1", "0", "-0.01", []),
    ("--adam-beta1", "0.999", "1.0", []),
    ("--adam-beta2", "0", "-0.01", []),
    ("--adam-beta2", "0.999", "1.0", []),
    ("--sgd-momentum", "0", "-0.01", ["--optimizer", "sgd"]),
    ("--sgd-momentum", "0.99", "1.0", ["--optimizer", "sgd"]),
    ("--adam-eps", "1e-12", "0", []),
    ("--weight-decay", "0", "-0.1", []),
    ("--clip-grad", "0", "-0.1", []),
    ("--loss-scale", "0.5", "0", ["--fp16"]),
    ("--initial-loss-scale", "1", "0", []),
    ("--min-loss-scale", "0.001", "0", []),
    ("--loss-scale-window", "1", "0", []),
    ("--hysteresis", "1", "0", []),
    ("--recompute-num-layers", "1", "0", RECOMPUTE),
    ("--max-consecutive-nonfinite", "1", "0", []),
    ("--loss-spike-window", "2", "1", []),
    ("--heartbeat-timeout-seconds", "0", "-1", []),
    ("--distributed-timeout-minutes", "0.01", "0", []),
    ("--loss-spike-factor", "1.01", "1.0", []),
    ("--save-interval", "1", "0", ["--save", "ckpt"]),
    ("--exit-interval", "1", "0", []),
    ("--exit-duration-in-mins", "0.01", "0", []),
    ("--eval-interval", "1", "0", []),
    ("--eval-iters", "0", "-1", []),
    ("--log-interval", "1", "0", []),
    ("--peak-tflops", "0.01", "0", []),
]


@pytest.mark.parametrize("flag_name, accepted, refused, extra", BOUNDARIES,
                         ids=[f"{b[0]}={b[2]}" for b in BOUNDARIES])
def test_each_numeric_check_at_its_boundary(flag_name, accepted, refused, extra):
    assert errors_of(BASE + extra + [flag_name, accepted]) == []
    errors = errors_of(BASE + extra + [flag_name, refused])
    assert len(errors) == 1 and errors[0].startswith(flag_name), errors


def test_validation_data_is_needed_only_when_validation_runs(tmp_path):
    # (The dataset files do not exist here: only the validation-data line is looked at.)
    data = ["--model-preset", "gpt-tiny", "--train-iters", "3", "--data-path", str(tmp_path / "c"),
            "--split", "100,0,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]

    def needs_validation(extra):
        return [e for e in errors_of(data + extra) if "--eval-interval needs validation data" in e]

    assert len(needs_validation(["--eval-interval", "5"])) == 1
    assert len(needs_validation(["--eval-interval", "5", "--eval-iters", "1"])) == 1
    assert needs_validation([]) == []  # no --eval-interval: no validation pass
    assert needs_validation(["--eval-interval", "5", "--eval-iters", "0"]) == []
    train_only = ["--model-preset", "gpt-tiny", "--train-iters", "3", "--train-data-path", str(tmp_path / "c"),
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--eval-interval", "5"]
    assert any("--eval-interval needs validation data: add --valid-data-path" in e for e in errors_of(train_only))


@pytest.mark.parametrize("extra, line", [
    (["--no-save-optim"], "--no-save-optim needs --save"),
    (["--save-interval", "5"], "--save-interval needs --save"),
    (["--finetune"], "--finetune needs --load"),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint needs --load"),
    (["--exit-signal-handler"], "--exit-signal-handler needs --save (it saves a checkpoint before exiting)"),
    (["--wandb-exp-name", "x"], "--wandb-exp-name needs --wandb-project"),
    (["--wandb-save-dir", "x"], "--wandb-save-dir needs --wandb-project"),
    (["--continue-on-save-failure"], "--continue-on-save-failure needs --save"),
    (["--min-loss-scale", "1", "--initial-loss-scale", "0.5"], "--min-loss-scale 1.0 is above --initial-loss-scale 0.5"),
])
def test_a_flag_without_the_flag_it_needs_is_one_line(extra, line):
    assert errors_of(BASE + extra) == [line]


@pytest.mark.parametrize("extra", [["--tensorboard-dir"], ["--wandb-project", "p", "--wandb-save-dir"],
                                   ["--save"], ["--load"]])
def test_an_output_directory_that_is_a_file_is_one_line(tmp_path, extra):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert errors_of(BASE + extra + [str(a_file)]) == [f"{extra[-1]} {a_file} is a file, not a directory"]


def test_group_query_attention_needs_its_group_count_unless_a_preset_gives_it():
    shape = ["--mock-data", "--train-iters", "3", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
             "4", "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128"]
    assert errors_of(shape) == []
    assert errors_of(shape + ["--group-query-attention"]) == ["--group-query-attention needs --num-query-groups"]
    assert errors_of(shape + ["--group-query-attention", "--num-query-groups", "2"]) == []
    assert errors_of(["--model-preset", "llama-tiny", "--mock-data", "--train-iters", "3",
                      "--group-query-attention"]) == []


@pytest.mark.parametrize("world,tp,dp_batch", [(2, 1, (1, 1)), (4, 2, (1, 1)), (4, 1, (1, 2))],
                         ids=["tp1-dp1", "tp2-dp1", "tp1-dp2"])
def test_the_schedule_is_checked_at_the_jobs_own_size_down_to_one_of_everything(world, tp, dp_batch):
    # Micro-batch 1, a global batch of one micro-batch per replica, dp and tp at their smallest: the sizes are
    # right, so the job's own lists (m = 1) are built and 2BW's m >= p refused, not waved through at a
    # nominal size the run does not have.
    mbs, gbs = dp_batch
    argv = BASE + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", str(tp),
                   "--pipeline-schedule", "2bw", "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs)]
    errors = validate_args(build_parser().parse_args(argv), world_size=world)
    assert len(errors) == 1 and errors[0].startswith("2bw needs at least as many microbatches"), errors
    doubled = argv[:-1] + [str(2 * gbs)]  # m = 2 = p: accepted
    assert validate_args(build_parser().parse_args(doubled), world_size=world) == []


@pytest.mark.parametrize("virtual", [["--num-virtual-stages-per-pipeline-rank", "2"],
                                     ["--num-layers-per-virtual-pipeline-stage", "1"]])
def test_virtual_stages_for_a_schedule_without_them_name_the_flag_given(virtual):
    argv = BASE + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--pipeline-schedule", "1f1b"]
    errors = validate_args(build_parser().parse_args(argv + virtual), world_size=2)
    assert len(errors) == 1 and "'1f1b' has no virtual stages" in errors[0] and virtual[0] in errors[0], errors


def test_every_registered_schedule_is_accepted_at_a_size_it_runs():
    from megatron_pp.schedules.registry import registered_schedules

    argv = BASE + ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "8"]
    for entry in registered_schedules():
        given = argv + ["--pipeline-schedule", entry.name]
        if entry.supports_virtual and entry.chunks_per_rank is None:
            given += ["--num-virtual-stages-per-pipeline-rank", "2"]
        assert validate_args(build_parser().parse_args(given), world_size=2) == [], entry.name


def _schedule_file(tmp_path, name: str, *sizes: int):
    """A registered schedule at `sizes` written as the JSON --pipeline-schedule-file reads; its path."""
    import json

    from megatron_pp.schedules.registry import build_schedule
    from megatron_pp.schedules.schedule_file import schedule_to_json

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(schedule_to_json(build_schedule(name, *sizes))))
    return path


def test_a_schedule_file_decides_the_chunks_the_layers_must_divide_into(tmp_path):
    path = _schedule_file(tmp_path, "gis", 2, 4, 2)  # 2 ranks x 2 chunks: 4 stages
    argv = BASE + ["--micro-batch-size", "1", "--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
                   "--pipeline-schedule-file", str(path)]
    for layers in ("4", "8"):
        assert validate_args(build_parser().parse_args(argv + ["--num-layers", layers]), world_size=2) == []
    errors = validate_args(build_parser().parse_args(argv + ["--num-layers", "6"]), world_size=2)
    assert len(errors) == 1 and errors[0].startswith("--num-layers 6 is not divisible by 4 pipeline stages"), errors


def test_a_schedule_named_beside_a_schedule_file_is_refused(tmp_path):
    # Either one alone runs; both would silently run one of them (the file), whatever the name said.
    path = _schedule_file(tmp_path, "1f1b", 2, 4)  # one chunk per rank: 6 layers split over its 2 stages
    argv = BASE + ["--micro-batch-size", "1", "--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
                   "--num-layers", "6", "--pipeline-schedule-file", str(path)]
    assert validate_args(build_parser().parse_args(argv), world_size=2) == []
    # The default's name too: given, it is a second choice. A V shape's two chunks per rank (4 stages, which
    # 6 layers do not fill evenly) are not applied to the file's layer split either: one line only.
    for name in ("1f1b", "gis", "zb-v"):
        errors = validate_args(build_parser().parse_args(argv + ["--pipeline-schedule", name]), world_size=2)
        assert errors == [f"--pipeline-schedule {name} and --pipeline-schedule-file {path} both name the schedule: "
                          "give one"], errors
    # With wrong sizes the file's own lists cannot be built; a conflict its flags state is still named, by flag
    # (no registered schedule stands in for the file).
    errors = validate_args(build_parser().parse_args(
        argv + ["--global-batch-size", "3", "--data-parallel-sharding-strategy", "optim_grads_params",
                "--offload-chunks", "1"]), world_size=4)
    assert errors == ["--global-batch-size 3 is not divisible by --micro-batch-size 1 x data-parallel size 2",
                      "--data-parallel-sharding-strategy optim_grads_params cannot be combined with --offload-chunks: "
                      "stashes parked off the device are not supported with sharded weights"], errors


def test_a_schedule_file_is_held_to_the_virtual_stages_either_flag_gives(tmp_path):
    path = _schedule_file(tmp_path, "1f1b", 2, 4)
    argv = BASE + ["--micro-batch-size", "1", "--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
                   "--num-layers", "6", "--pipeline-schedule-file", str(path)]
    for extra, chunks in ((["--num-virtual-stages-per-pipeline-rank", "2"], 2),
                          (["--num-layers-per-virtual-pipeline-stage", "1"], 3)):
        errors = validate_args(build_parser().parse_args(argv + extra), world_size=2)
        assert errors[0] == (f"--pipeline-schedule-file {path} has 1 for chunks per rank (virtual stages), the job "
                             f"has {chunks}"), errors
    # A file whose chunks the flag matches: the layer split is checked once, with the flag's chunks.
    gis = _schedule_file(tmp_path, "gis", 2, 4, 2)
    errors = validate_args(build_parser().parse_args(
        [a if a != str(path) else str(gis) for a in argv] + ["--num-virtual-stages-per-pipeline-rank", "2"]),
        world_size=2)
    assert len(errors) == 1 and errors[0].startswith("--num-layers 6 is not divisible by 4 pipeline stages"), errors


def test_the_job_schedule_helpers_that_pretrain_calls(tmp_path):
    from megatron_pp.training.arguments import build_job_schedule, schedule_takes_offload_time

    sizes = ["--micro-batch-size", "1", "--global-batch-size", "4", "--pipeline-model-parallel-size", "2"]
    path = _schedule_file(tmp_path, "1f1b", 2, 4)
    file_job = BASE + sizes + ["--pipeline-schedule-file", str(path)]
    # --offload-time matters where host copies are placed: a file job with either offload flag, or a
    # registered schedule that offloads.
    assert [schedule_takes_offload_time(build_parser().parse_args(file_job + extra))
            for extra in ([], ["--offload-chunks", "1"], ["--offload-fraction", "0.5"])] == [False, True, True]
    registered = [["1f1b"], ["1f1b", "--offload-chunks", "1"], ["zb-h1", "--offload-fraction", "0.5"], ["po-h"],
                  ["po-f"], ["interleaved-1f1b"]]
    assert [schedule_takes_offload_time(build_parser().parse_args(BASE + sizes + ["--pipeline-schedule", *flags]))
            for flags in registered] == [False, True, True, True, True, False]
    # A registered schedule without a chunk count has one; a measured offload time reaches the placement.
    args = build_parser().parse_args(BASE + sizes + ["--pipeline-schedule", "po-h"])
    assert build_job_schedule(args, 1, None).num_chunks == 1
    assert build_job_schedule(args, 1, None, offload_time=0.5).options["offload_time"] == 0.5
    assert build_job_schedule(args, 1, None).options["offload_time"] == 0.25  # the default


@pytest.mark.parametrize("sizes", [["--micro-batch-size", "0"], ["--global-batch-size", "3", "--micro-batch-size", "2"]])
def test_a_schedule_option_that_does_not_apply_is_named_beside_wrong_sizes(sizes):
    # The sizes' own errors do not hide the flag's: the user fixes both in one go.
    errors = errors_of(BASE + ["--pipeline-schedule", "1f1b", "--microbatch-group-size-per-vp-stage", "4", *sizes])
    assert len(errors) == 2
    assert errors[1].startswith("--microbatch-group-size-per-vp-stage does not apply to --pipeline-schedule 1f1b")


def test_a_world_the_parallel_sizes_do_not_divide_reports_only_that():
    # Without a data-parallel size there is no job size: the schedule's own size checks (2BW's m >= p here,
    # which a right world would report) must not run on a made-up one.
    args = build_parser().parse_args(BASE + ["--pipeline-schedule", "2bw", "--pipeline-model-parallel-size", "2",
                                             "--global-batch-size", "1"])
    assert validate_args(args, world_size=3) == [
        "world size 3 is not divisible by --tensor-model-parallel-size 1 x --pipeline-model-parallel-size 2"]
    assert validate_args(args, world_size=2)[0].startswith("2bw needs at least as many microbatches")


@pytest.mark.parametrize("pp", ["1", "2"])
def test_what_a_schedule_refuses_is_named_beside_wrong_sizes_at_any_pipeline_size(pp):
    # With wrong sizes the schedule is built at a size it accepts, to read what it needs: at pp 1 too.
    errors = errors_of(BASE + ["--pipeline-schedule", "2bw", "--use-distributed-optimizer", "--micro-batch-size",
                               "0", "--pipeline-model-parallel-size", pp])
    assert errors[0] == "--micro-batch-size must be >= 1, got 0"
    assert errors[-1].endswith("--use-distributed-optimizer is not supported with it")


def test_the_model_shape_is_checked_at_the_runs_own_tensor_parallel_size():
    # Three heads split over one tensor-parallel rank, not over two: fine at tp 1, refused at tp 2.
    odd_heads = BASE + ["--num-attention-heads", "3", "--hidden-size", "48"]
    assert errors_of(odd_heads) == []
    assert "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2" in errors_of(
        odd_heads + ["--tensor-model-parallel-size", "2"])
