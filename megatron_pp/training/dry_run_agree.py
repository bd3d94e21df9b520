"""Do the simulated ranks of a dry run agree with each other? Sends against receives, groups in step.

Each rank of a dry run runs alone on the fake backend, where every call returns at once: a send nobody
receives, or a collective one member calls with another shape, passes unnoticed there and hangs (or
corrupts) the real job. `core.comm_check.CommWatch` records every call per rank; this module matches them:

- point to point: for every ordered pair (a, b) of simulated ranks, the k-th send from a to b has the
  shape and dtype of the k-th receive b posts from a (NCCL and gloo match messages in posting order);
- collectives: every simulated member of a group calls the same operators with the same shapes and dtype,
  in the same order.

Only ranks that were simulated can be matched (`--dry-run-ranks all` checks everything). Worked example:
rank 0 sends [4, 2, 8] float32 to rank 1, which receives [4, 2, 16] -> one line, "send 0 -> 1 #0: rank 0
sends [4, 2, 8] float32, rank 1 receives [4, 2, 16] float32".
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from megatron_pp.core.comm_check import CommEvent


def _payload(e: CommEvent) -> str:
    return f"{'x'.join(str(list(s)) for s in e.shapes)} {e.dtype}"


def disagreements(events: Mapping[int, Sequence[CommEvent]]) -> list[str]:
    """One line per mismatch among the simulated ranks' recorded calls (empty: they agree)."""
    lines: list[str] = []
    sends: dict[tuple[int, int], list[CommEvent]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[CommEvent]] = defaultdict(list)
    calls: dict[tuple[int, ...], dict[int, list[CommEvent]]] = defaultdict(lambda: defaultdict(list))
    for rank, evs in events.items():
        for e in evs:
            if e.op == "send":
                sends[(rank, e.peer)].append(e)
            elif e.is_p2p:
                recvs[(e.peer, rank)].append(e)
            elif len(e.group) > 1:
                calls[e.group][rank].append(e)
    for (a, b) in sorted(set(sends) | set(recvs)):
        if a not in events or b not in events:
            continue
        out, into = sends.get((a, b), []), recvs.get((a, b), [])
        for k in range(max(len(out), len(into))):
            if k >= len(out) or k >= len(into):
                lines.append(f"send {a} -> {b} #{k}: rank {a} sends {len(out)} messages, rank {b} receives {len(into)}")
                break
            if _payload(out[k]) != _payload(into[k]):
                lines.append(f"send {a} -> {b} #{k}: rank {a} sends {_payload(out[k])}, "
                             f"rank {b} receives {_payload(into[k])}")
    for group, by_rank in sorted(calls.items()):
        members = [r for r in group if r in events]
        if len(members) < 2:
            continue
        first = members[0]
        for other in members[1:]:
            a, b = by_rank.get(first, []), by_rank.get(other, [])
            for k in range(max(len(a), len(b))):
                if k >= len(a) or k >= len(b) or (a[k].op, _payload(a[k])) != (b[k].op, _payload(b[k])):
                    what = lambda evs: f"{evs[k].op} {_payload(evs[k])}" if k < len(evs) else "nothing"
                    lines.append(f"group {list(group)} call #{k}: rank {first} calls {what(a)}, "
                                 f"rank {other} calls {what(b)}")
                    break
    return lines
