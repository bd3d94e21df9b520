"""Safety: checkpoints never run code when loaded (weights_only everywhere, a crafted pickle is refused:
see also the `ckpt-pickle-code` row of test_bad_input.py), config files cannot send outputs outside the
run directory, and credentials never reach logs, metrics, checkpoint metadata or wandb's files."""
from __future__ import annotations

import os
import pickle
import re

import pytest

from megatron_pp.training.arguments import build_parser, expand_config_file, parse_args
from megatron_pp.training.checkpointing import CheckpointError, load_shard
from megatron_pp.training.train import REDACTED, loggable_settings, pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a wandb API key (40 hex digits)


def _python_sources():
    for top in ("megatron_pp", "tools", "benchmarks", "dev"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.join(dirpath, name)
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            yield os.path.join(ROOT, name)


def test_every_load_of_a_saved_file_is_code_free():
    """torch.load only with weights_only=True (its call spans to the closing parenthesis), no pickle.load,
    no np.load with allow_pickle."""
    offenders = []
    for path in _python_sources():
        text = open(path).read()
        for match in re.finditer(r"torch\.load\(", text):
            call = text[match.end():text.find(")", match.end()) + 1]
            if "weights_only=True" not in call:
                offenders.append(f"{path}: torch.load without weights_only=True")
        if re.search(r"\bpickle\.loads?\(|allow_pickle\s*=\s*True", text):
            offenders.append(f"{path}: pickle load")
    assert offenders == []


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_checkpoint_file_is_refused_without_running_its_code(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "model_stage000_tp00.pt"
    with open(path, "wb") as f:
        pickle.dump({"model": _Payload(str(marker))}, f)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_shard(str(path), "cpu")
    assert not marker.exists()


@pytest.mark.parametrize("key,value", [("save", "/abs/ck"), ("tensorboard-dir", "../tb"), ("wandb_save_dir", "~/wb"),
                                       ("trace-file", "runs/../../t.json"), ("data-cache-path", "/cache")])
def test_config_files_cannot_send_outputs_outside_the_run_directory(tmp_path, key, value, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"{key}: {value}\n")
    with pytest.raises(SystemExit) as info:
        parse_args(["--config", str(config), "--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "1"])
    assert info.value.code == 2
    # The only problem, and the one refused: the output path (not some other flag's error).
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --config {config}: {key} {value!r} points outside the run directory (absolute, '~' or '..'); a config "
        f"file may only name outputs below the directory the job starts in; give --{key.replace('_', '-')} on the "
        "command line to write elsewhere"]


def test_relative_outputs_in_config_files_and_any_path_on_the_command_line_are_fine(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("save: runs/ck\nmetrics-file: m.jsonl\n")
    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, ["--config", str(config), "--save", str(tmp_path / "ck")]))
    assert args.save == str(tmp_path / "ck") and args.metrics_file == "m.jsonl"


def test_settings_that_look_like_credentials_are_redacted(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    safe = loggable_settings({"wandb_api_key": "abc", "note": f"key={FAKE_KEY}", "data_path": ["a", FAKE_KEY],
                              "lr": 1e-3, "eod_token": "<|endoftext|>"})
    assert safe == {"wandb_api_key": REDACTED, "note": REDACTED, "data_path": ["a", REDACTED], "lr": 1e-3,
                    "eod_token": "<|endoftext|>"}


def test_only_credential_variables_long_enough_to_be_one_redact_other_settings(monkeypatch):
    # A path in an ordinary variable is not a secret; nor is a credential variable's value too short to be
    # one ("1", "yes"), which would otherwise blank every setting that contains it.
    monkeypatch.setenv("MEGATRON_PP_TEST_DATA_ROOT", "/datasets/corpus-v2")
    monkeypatch.setenv("HF_TOKEN_SECRET", "yes")
    monkeypatch.setenv("API_SECRET", "7chars!")  # one short of the 8 characters a secret needs
    monkeypatch.setenv("S3_PASSWORD", "8chars!!")
    safe = loggable_settings({"data_path": ["/datasets/corpus-v2/train"], "note": "yes", "seven": "7chars!",
                              "other": "x8chars!!y"})
    assert safe == {"data_path": ["/datasets/corpus-v2/train"], "note": "yes", "seven": "7chars!",
                    "other": REDACTED}


def test_wandb_key_never_reaches_any_output(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_MODE", "offline")  # never talk to a server from a test
    pretrain(parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--train-iters", "2",
                         "--metrics-file", str(tmp_path / "m.jsonl"), "--save", str(tmp_path / "ck"),
                         "--wandb-project", "reliability", "--wandb-save-dir", str(tmp_path / "wb"),
                         "--tensorboard-dir", str(tmp_path / "tb")]))
    printed = capfd.readouterr()
    assert FAKE_KEY not in printed.out + printed.err
    scanned = 0
    for dirpath, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert FAKE_KEY.encode() not in f.read(), os.path.join(dirpath, name)
            scanned += 1
    assert scanned >= 8  # metrics, checkpoint shards and metadata, TensorBoard events, wandb's run files
