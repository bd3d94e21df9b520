"""BPipe in the dry run: EVICT/ACCEPT/LOAD/RETURN on the fake backend, held to a real gloo run of the same job.

The acceptor learns its partner's stash layout by dry-running the partner up to its first eviction
(`training.dry_run_bpipe`); on the fake backend a stash transfer is complete once posted and waited for
(`peer_store.Transfers.waited`), where it once spun for ever.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_pp.core.comm_check import fake_world
from megatron_pp.schedules.peer_store import AcceptorStore, PeerLink
from megatron_pp.training import dry_run, dry_run_bpipe
from megatron_pp.training.arguments import parse_args
from tests.dist import run_distributed

# gpt-tiny at pp 4, m 8, one layer a stage: K = 3, rank 0 parks microbatches 3..7 on rank 3.
ARGV = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "2", "--pipeline-model-parallel-size", "4", "--num-layers", "4",
        "--pipeline-schedule", "bpipe", "--dry-run", "4"]
EXACT = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "stash_peak_bytes", "guest_peak_bytes",
         "host_bytes", "host_peak_bytes")


def _real_rank(ctx, argv: list[str]) -> dict:
    """The dry run's own code (`dry_run._run`) on real tensors, on this gloo rank, counted by the same tracker."""
    args = parse_args(argv)
    tracker = dry_run.MemoryTracker()
    with tracker:
        report = dry_run._run(args, ctx.parallel_state(1, 4), None, tracker, steps=2)
    return report.row()


def _argv(schedule: str) -> list[str]:
    return [schedule if a == "bpipe" else a for a in ARGV]


@pytest.fixture(scope="module")
def runs() -> dict:
    """Per schedule (bpipe, and 1f1b for reference): the dry run of every rank (reports, disagreements) and the
    real gloo run's rows."""
    out = {}
    for schedule in ("bpipe", "1f1b"):
        every_rank = ["--dry-run-ranks", "all", "--dry-run-jobs", "1"]
        fake, problems = dry_run.dry_run(parse_args(_argv(schedule) + every_rank))
        real = sorted(run_distributed(4, _real_rank, _argv(schedule)), key=lambda row: row["rank"])
        out[schedule] = (fake, problems, real)
    return out


def test_every_rank_equals_the_real_gloo_run_to_the_byte(runs):
    fake, problems, real = runs["bpipe"]
    assert problems == []  # every EVICT matches its ACCEPT, every RETURN its LOAD, header included
    for f, r in zip((report.row() for report in fake), real):
        for key in EXACT:
            assert f[key] == r[key], (f["rank"], key, f[key], r[key])
    # Rank 3 hosts rank 0's stashes (one at a time: its list's hosting bound), nobody else hosts anything.
    assert [report.guest_peak_bytes > 0 for report in fake] == [False, False, False, True]


def test_parked_stashes_leave_the_evictor_and_what_bpipe_adds_elsewhere_is_the_real_runs(runs):
    """The total peak (every live storage). The evictor's parked stashes really leave it: its total peak is below
    1F1B's, where 1F1B holds the same p stashes at p = 4 (the finished eviction's transfer once kept every parked
    storage alive until its LOAD, so rank 0 peaked above 1F1B although its store counted the stashes gone). On
    gloo an eviction holds its stash until the partner's receive has taken it, at the partner's pace, so the real
    evictor holds at most one stash more than the dry run, where a transfer is complete once posted. Every other
    rank: what BPipe adds over 1F1B equals the real run's to the byte (the real total is above the dry run's by
    the same bytes under both schedules: a gap of the pipeline's own transfers on gloo), the acceptor's guest."""
    (bp_fake, _, bp_real), (one_fake, problems, one_real) = runs["bpipe"], runs["1f1b"]
    assert problems == []
    added_fake = [b.peak_bytes - o.peak_bytes for b, o in zip(bp_fake, one_fake)]
    added_real = [b["peak_bytes"] - o["peak_bytes"] for b, o in zip(bp_real, one_real)]
    assert added_fake[1:] == added_real[1:]
    assert added_fake[1:3] == [0, 0] and added_fake[3] > 0  # ranks 1, 2 do not move; the acceptor pays
    one_stash = one_fake[0].stash_peak_bytes // 4
    assert added_fake[0] < 0
    assert added_fake[0] <= added_real[0] <= added_fake[0] + one_stash


def test_the_evictor_holds_k_plus_1_and_the_acceptor_a_guest_of_the_evictors_size(runs):
    """Against 1F1B's dry run of the same job: rank 0 holds K + 1 = 4 = p stashes either way (p = 4 is
    BPipe's tightest case), rank 3 its own stash plus the parked part of one of rank 0's."""
    fake, plain = runs["bpipe"][0], runs["1f1b"][0]
    one_stash = [r.stash_peak_bytes / min(4 - r.pipeline_rank, 8) for r in plain]
    assert fake[0].stash_peak_bytes == plain[0].stash_peak_bytes
    # A guest is rank 0's stash less what stays home (storages of <= 1024 elements, the batch, the output
    # still to be sent), and rank 3 peaks at exactly its 1F1B peak plus one guest.
    assert 0.95 * one_stash[0] <= fake[3].guest_peak_bytes <= one_stash[0]
    assert fake[3].stash_peak_bytes == plain[3].stash_peak_bytes + fake[3].guest_peak_bytes
    assert max(r.stash_peak_bytes for r in fake) <= plain[0].stash_peak_bytes  # the bound, (K + 1)/p = 1


def test_an_acceptor_alone_learns_its_partners_layout(runs):
    """`--dry-run-ranks 3` alone: rank 3 first dry-runs rank 0 up to its first eviction (and no further) and then
    gives the row it gives in the all-rank run; ranks that host nothing run no partner."""
    fake = runs["bpipe"][0]
    args = parse_args(ARGV)
    assert [dry_run_bpipe.evicting_partner(args, r) for r in range(4)] == [None, None, None, 0]
    partners = []

    def run_partner(partner, stop):
        partners.append(partner)
        return dry_run.run_rank(args, partner, torch.device("cpu"), 1, stop)
    assert dry_run_bpipe.acceptor_prepare(args, 1, run_partner) is None and partners == []
    assert dry_run_bpipe.acceptor_prepare(args, 3, run_partner) is not None and partners == [0]
    drop = lambda row: {k: v for k, v in row.items() if k not in ("seconds", "step_seconds")}  # noqa: E731
    assert drop(dry_run.run_rank(args, 3, torch.device("cpu")).row()) == drop(fake[3].row())


def test_fake_transfers_are_done_once_waited_and_a_missing_layout_is_named():
    """On the fake backend works never report completion: a transfer is retired by its explicit wait (it
    once spun in `Transfers.finish`); an acceptor without its partner's layout says so instead of reading data
    a fake receive never delivers."""
    with fake_world(1, 2):
        group = dist.new_group([0, 1])
        link = PeerLink((group, group), 0, torch.device("cpu"))
        assert link.at_once
        sent = link.send_back([torch.zeros(8, dtype=torch.uint8)])
        assert sent.done() and not any(w.is_completed() for w in sent.works)
        sent.finish()
        store = AcceptorStore(link=link)
        with pytest.raises(RuntimeError, match="must be known ahead"):
            store.accept((3, 0))
        store.known_layouts[0] = [16, 32]
        store.accept((3, 0))
        assert store.guest_bytes == 48 and store._incoming[3, 0].done()
        store.give_back((3, 0))
        store.end_step()
        assert store.guest_bytes == 0


def test_a_real_link_is_not_at_once():
    """gloo: the link waits for real completion, as before (`at_once` is the fake backend's alone)."""
    assert run_distributed(2, _link_at_once) == [False, False]


def _link_at_once(ctx) -> bool:
    state = ctx.parallel_state(1, 2)
    other = 1 - state.pp_rank
    return PeerLink(state.pair_groups([(0, 1)])[other], state.pp_global_rank(other), state.device).at_once



def test_a_meta_dry_run_parks_and_agrees_as_the_cpu_one():
    """--dry-run-device meta (the device check at every collective): the stash byte views are made on the saved
    tensors' device, not their storage's (`meta` for any fake tensor), so the parking calls pass the check; the
    ranks agree, and BPipe moves what it moves on the CPU: rank 0 at its 1F1B peak, rank 3 at its own plus one
    guest."""
    flags = ["--dry-run-ranks", "all", "--dry-run-jobs", "1", "--dry-run-device", "meta"]
    bp, problems = dry_run.dry_run(parse_args(ARGV + flags))
    one, problems_1f1b = dry_run.dry_run(parse_args(_argv("1f1b") + flags))
    assert problems == problems_1f1b == []
    assert bp[0].stash_peak_bytes == one[0].stash_peak_bytes
    assert bp[3].guest_peak_bytes > 0 and bp[3].stash_peak_bytes == one[3].stash_peak_bytes + bp[3].guest_peak_bytes
