"""tools/bpipe_dry_run.py: BPipe's lists at the GPT-3 96B setting hold the bound in stashes, no ACCEPT is
posted earlier than its transfer needs, and bad input is one line, exit 2 (the dry runs themselves are the
committed JSONs' commands: minutes each)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bpipe_dry_run as tool  # noqa: E402


@pytest.mark.parametrize("pp, m, layers, stashes", [
    (4, 8, None, [4, 3, 2, 2]),  # K = 3: rank 0 holds K + 1 = p, the acceptor its own and one guest
    (8, 16, 16, [6, 6, 6, 5, 4, 4, 4, 4]),  # K = 5: (K + 1)/p = 0.75 of 1F1B's rank 0
])
def test_bpipe_lists_hold_the_bound_and_post_no_accept_early(pp, m, layers, stashes):
    argv = tool.argv_of("bpipe", pp, m, layers)
    peaks, counts = tool.simulated_peaks(argv, [1.0] * pp)
    assert counts == stashes and max(peaks) <= (-(-(pp + 2) // 2) + 1)
    assert tool.accept_slack(argv) == [0] * pp
    one, _ = tool.simulated_peaks(tool.argv_of("1f1b", pp, m, layers), [1.0] * pp)
    assert one == [float(min(pp - s, m)) for s in range(pp)]


@pytest.mark.parametrize("argv, message", [
    (["--pp", "8", "--microbatches", "16"], "--pp 8 must be >= 2 and divide --num-layers 84"),
    (["--pp", "4", "--microbatches", "2"], "--microbatches 2 must be >= --pp 4"),
    (["--pp", "4", "--microbatches", "8", "--dry-run-schedules", "bpipe"], "--dry-run-schedules 'bpipe'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert tool.main(argv + ["--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_bound_over_activations_with_the_batch_apart(monkeypatch):
    """gpt-tiny at p = 8, m = 16 (K = 5), rank 0: with the step's batch tensors counted apart, BPipe's stash peak is
    exactly (K + 1)/p of 1F1B's. The dry run's own count keeps the batch tensors a stash saved (here the token
    and position ids of tp 1's embedding) in every live stash, parked ones included, so there both peaks hold the
    same p microbatches' ids and BPipe's sits above 6/8 by them; `batch_saved_bytes` are every microbatch's.
    The evictor parks every storage here (`min_numel` 0): by default it keeps those of <= 1024 elements, which at
    this size (norm statistics of 32 tokens) are a parked stash's 1 KiB, and at the 96B's none."""
    import torch

    from megatron_pp.schedules.peer_store import PeerStore
    from megatron_pp.training import dry_run
    from megatron_pp.training.arguments import parse_args

    init = PeerStore.__init__
    monkeypatch.setattr(PeerStore, "__init__", lambda self, *a, **kw: init(self, *a, **{**kw, "min_numel": 0}))
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "16",
            "--train-iters", "2", "--pipeline-model-parallel-size", "8", "--num-layers", "8", "--dry-run", "8"]
    apart, plain, saved = {}, {}, {}
    for schedule in ("1f1b", "bpipe"):
        args = parse_args(argv + ["--pipeline-schedule", schedule])
        report, saved[schedule] = tool.run_rank(args, 0)
        apart[schedule] = report.stash_peak_bytes
        plain[schedule] = dry_run.run_rank(args, 0, torch.device("cpu")).stash_peak_bytes
    ids = saved["1f1b"] // 16  # one microbatch's: 32 position ids and the 33 sampled token ids, int64
    assert saved["bpipe"] == saved["1f1b"] == 16 * 520
    assert 8 * apart["bpipe"] == 6 * apart["1f1b"]
    assert plain["1f1b"] - apart["1f1b"] == plain["bpipe"] - apart["bpipe"] == 8 * ids
    assert tool.within(apart["bpipe"], 6, 8, apart["1f1b"]) and not tool.within(plain["bpipe"], 6, 8, plain["1f1b"])
