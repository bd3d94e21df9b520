"""Issue 34's bad input through the real entry point (`train.main`, what pretrain_gpt.py runs): blend weights
that do not sum to a positive number, a `--split` that leaves a split the run needs without sequences, and
an index cache made for other flags each end with one `error:` line naming the flag or file, exit 2, before
any training (no metrics row, no checkpoint written)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from megatron_pp.data.indexed import write_dataset
from megatron_pp.training.train import main

TINY = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--seed", "3",
        "--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(2)
    for name in ("a", "b"):  # 40 documents each: --split 99,1,0 leaves validation [round(.99·40), 40) = [40, 40)
        write_dataset(str(tmp_path / name), [np.append(rng.integers(0, 300, 30), 300) for _ in range(40)], np.uint16)
    return str(tmp_path / "a"), str(tmp_path / "b")


def _fails(argv, out, capsys) -> str:
    out.mkdir()
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv + ["--metrics-file", str(out / "metrics.jsonl"), "--save", str(out / "ck"), "--save-interval", "1"])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert os.listdir(out) == [], os.listdir(out)  # nothing trained, nothing written
    return err


def test_blend_weights_summing_to_zero_are_one_line_exit_2(corpus, tmp_path, capsys):
    a, b = corpus
    err = _fails(TINY + ["--data-path", "0", a, "0", b, "--split", "100,0,0"], tmp_path / "out", capsys)
    assert "--data-path" in err and "sum to 0" in err, err


def test_a_split_leaving_a_needed_split_empty_is_one_line_exit_2(corpus, tmp_path, capsys):
    a, _ = corpus
    err = _fails(TINY + ["--data-path", a, "--split", "99,1,0", "--eval-iters", "1", "--eval-interval", "1"],
                 tmp_path / "out", capsys)
    assert "--data-path: --split 99,1,0 leaves" in err and "valid" in err, err


def test_an_index_cache_made_for_other_flags_is_one_line_exit_2(corpus, tmp_path, capsys):
    a, _ = corpus
    cache = tmp_path / "cache"
    argv = TINY + ["--data-path", a, "--split", "100,0,0", "--data-cache-path", str(cache)]
    main(argv + ["--metrics-file", str(tmp_path / "first.jsonl")])  # builds the cache
    descriptions = [p for p in cache.rglob("*.json")]
    assert descriptions
    for path in descriptions:  # as if another --seed had written them under these names
        text = path.read_text()
        assert '"seed": 3' in text, text
        path.write_text(text.replace('"seed": 3', '"seed": 4'))
    err = _fails(argv, tmp_path / "out", capsys)
    assert "made for other flags" in err and str(cache) in err, err


def test_ckpt_format_names_the_converter_target_that_writes_that_format(tmp_path, capsys):
    """--ckpt-format torch|torch_dist: the start-up line names the converter's --target-format, and an export
    of our checkpoint with that target is the format Megatron-LM's loader expects for the flag's value
    (args.ckpt_format in the files it writes)."""
    import torch

    from megatron_pp.convert import convert_checkpoint
    from megatron_pp.convert.megatron_lm import rank_directory
    from megatron_pp.training.arguments import build_parser
    from megatron_pp.training.checkpointing import iteration_dir
    from megatron_pp.training.megatron_compat import CKPT_FORMATS, accepted_without_effect

    assert sorted(CKPT_FORMATS) == ["torch", "torch_dist"]
    ours = str(tmp_path / "ours")
    main(["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
          "--train-iters", "1", "--save", ours])
    for value, target in CKPT_FORMATS.items():
        line = accepted_without_effect(build_parser().parse_args(["--ckpt-format", value]))
        assert f"--ckpt-format {value} (" in line and f"--target-format {target} writes Megatron-LM's" in line, line
        save = str(tmp_path / value)
        convert_checkpoint("megatron_pp", target, ours, save, transformer_impl="local", progress=False)
        directory = iteration_dir(save, 1)
        file = (os.path.join(directory, rank_directory(0, 0, 1), "model_optim_rng.pt") if value == "torch"
                else os.path.join(directory, "common.pt"))
        assert torch.load(file, weights_only=False)["args"].ckpt_format == value
