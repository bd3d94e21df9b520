"""The dry run's byte count against allocations of known size, and its per-rank row (megatron_pp/training/dry_run.py).

tests/training/test_dry_run.py holds the dry run to a real run of the same code, through the same tracker, so a
count that is off by the same amount in both (a tracker starting one byte low, issue 37's mutation survivor
`self.live_bytes = -1`) passes there. Here each figure is checked against bytes known in advance: live, peak,
host and hosted-for-a-partner counts, on real tensors (`MemoryTracker`) and on fake ones (`TrackingFakeMode`),
from a fresh tracker, through views, frees and a second peak.
"""
from __future__ import annotations

import pytest
import torch

from megatron_pp.training import dry_run

N_A, N_B, N_C = 1000, 300, 700  # elements; float32, float64 and float32 below


def _tracker(kind: str):
    return dry_run.MemoryTracker() if kind == "real" else dry_run.TrackingFakeMode()


def _walk(tracker) -> list[tuple[str, int, int]]:
    """Allocate, view, free and allocate again inside `tracker`; (label, live, peak) after each move. Only
    attribute reads between the operators, so the tracker sees exactly these allocations."""
    seen = [("fresh", tracker.live_bytes, tracker.peak_bytes)]
    with tracker:
        tracker.where = "a"
        a = torch.empty(N_A, dtype=torch.float32)
        seen.append(("a", tracker.live_bytes, tracker.peak_bytes))
        view = a[10:20]  # a view of a's storage: no new bytes
        seen.append(("view", tracker.live_bytes, tracker.peak_bytes))
        tracker.where = "b"
        b = torch.empty(N_B, dtype=torch.float64)
        seen.append(("b", tracker.live_bytes, tracker.peak_bytes))
        del a  # the view keeps a's storage alive
        seen.append(("a dropped, view kept", tracker.live_bytes, tracker.peak_bytes))
        del view
        seen.append(("view dropped", tracker.live_bytes, tracker.peak_bytes))
        tracker.where = "c"
        c = torch.empty(N_C, dtype=torch.float32)  # below the earlier peak
        seen.append(("c", tracker.live_bytes, tracker.peak_bytes))
        del b, c
        seen.append(("all dropped", tracker.live_bytes, tracker.peak_bytes))
    return seen


@pytest.mark.parametrize("kind", ["real", "fake"])
def test_live_and_peak_bytes_are_the_allocations_to_the_byte(kind):
    tracker = _tracker(kind)
    a, b, c = 4 * N_A, 8 * N_B, 4 * N_C
    assert _walk(tracker) == [
        ("fresh", 0, 0),
        ("a", a, a),
        ("view", a, a),
        ("b", a + b, a + b),
        ("a dropped, view kept", a + b, a + b),
        ("view dropped", b, a + b),
        ("c", b + c, a + b),
        ("all dropped", 0, a + b),
    ]
    assert tracker.peak_at == "b"  # where the peak was reached, not where the last allocation ran
    assert tracker.live == {}


@pytest.mark.parametrize("kind", ["real", "fake"])
def test_host_side_storages_count_apart_from_the_device(kind):
    """PipeOffload's host buffers: allocated while `host_side` is set, counted as host bytes and never in the
    device's live or peak bytes; freed, they leave the host count."""
    tracker = _tracker(kind)
    with tracker:
        device = torch.empty(N_A, dtype=torch.float32)
        tracker.host_side = True
        host = torch.empty(N_B, dtype=torch.float64)
        host2 = torch.empty(N_C, dtype=torch.float32)
        tracker.host_side = False
        during = (tracker.live_bytes, tracker.peak_bytes, tracker.host_bytes, tracker.host_peak_bytes)
        del host
        after_one = (tracker.host_bytes, tracker.host_peak_bytes)
        del host2, device
        after_all = (tracker.live_bytes, tracker.host_bytes, tracker.host_peak_bytes)
    assert during == (4 * N_A, 4 * N_A, 8 * N_B + 4 * N_C, 8 * N_B + 4 * N_C)
    assert after_one == (4 * N_C, 8 * N_B + 4 * N_C)
    assert after_all == (0, 0, 8 * N_B + 4 * N_C)


@pytest.mark.parametrize("kind", ["real", "fake"])
def test_guest_storages_stay_in_the_device_count_and_are_counted_apart(kind):
    """BPipe's buffers for a partner's stash: still device bytes, and also counted as guests, once each."""
    tracker = _tracker(kind)
    with tracker:
        own = torch.empty(N_A, dtype=torch.float32)
        guest = torch.empty(N_B, dtype=torch.float64)
        tracker.mark_guests([guest, guest[5:], guest])  # views and repeats of one storage count once
        during = (tracker.live_bytes, tracker.guest_bytes, tracker.guest_peak_bytes)
        del guest
        after = (tracker.live_bytes, tracker.guest_bytes, tracker.guest_peak_bytes)
        del own
    assert during == (4 * N_A + 8 * N_B, 8 * N_B, 8 * N_B)
    assert after == (4 * N_A, 0, 8 * N_B)
    assert tracker.live_bytes == 0 and tracker.peak_bytes == 4 * N_A + 8 * N_B


def test_a_rank_row_counts_its_collectives_and_point_to_point_calls_apart():
    """`RankReport.row()` (a line of --dry-run-json) replaces the recorded calls by their counts: collectives
    (every call that is not a send or a receive) and point-to-point calls (issue 37's seed-44 survivor counted
    no collective at all, and no test read the count)."""
    from megatron_pp.core.comm_check import CommEvent

    calls = [CommEvent("allreduce_", (0, 1), None, ((8,),), "torch.float32"),
             CommEvent("send", (0, 2), 2, ((4, 1, 8),), "torch.float32"),
             CommEvent("recv_", (0, 2), 2, ((4, 1, 8),), "torch.float32"),
             CommEvent("allgather_", (0, 1), None, ((8,), (8,)), "torch.float32"),
             CommEvent("allreduce_", (0, 1), None, ((1,),), "torch.float32")]
    report = dry_run.RankReport(rank=0, pipeline_rank=0, tensor_rank=0, data_rank=0, parameter_bytes=1,
                                gradient_bytes=1, optimizer_bytes=2, stash_peak_bytes=0, transient_peak_bytes=0,
                                peak_bytes=4, peak_at="F0.0", seconds=0.0, comm=calls)
    row = report.row()
    assert (row["collectives"], row["p2p"]) == (3, 2)
    assert "comm" not in row and row["peak_bytes"] == 4


def test_no_partner_stash_is_counted_where_no_rank_parks_one():
    """Outside BPipe no rank hosts a partner's stash: both hosted-for-a-partner figures of a real dry run are 0,
    while its own stash is live at the peak (issue 37's seed-44 survivor reported the own stash's bytes at the
    peak as the partner's)."""
    from megatron_pp.training.arguments import parse_args

    args = parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2",
                       "--global-batch-size", "8", "--train-iters", "2", "--dry-run", "1"])
    report = dry_run.run_rank(args, 0, torch.device("cpu"))
    assert report.stash_peak_bytes > 0 and report.peak_at.split(", ")[-1][0] in "FB"  # the peak falls in a pass
    assert (report.guest_peak_bytes, report.guest_at_peak_bytes) == (0, 0)
    persistent = report.parameter_bytes + report.gradient_bytes + report.optimizer_bytes
    assert persistent + report.transient_peak_bytes < report.peak_bytes  # own stash bytes live at the peak
