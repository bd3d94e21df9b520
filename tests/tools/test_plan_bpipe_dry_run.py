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
