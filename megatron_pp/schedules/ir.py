"""The schedule IR: one `Action` per step of a pipeline rank and a `Schedule` holding every rank's list.

A schedule is data. Generators produce it, passes rewrite it, the validator checks it, the simulator
times it and the executor runs exactly the same lists. Every action prints in a compact text form
(`F3.1` is the forward of microbatch 3 on local chunk 1) that parses back to the same action, so
schedules can be diffed, stored as text and compared with other systems' orders.

Text form (``mb`` microbatch, ``c`` local chunk on this rank, ``q`` peer pipeline rank, ``@w`` an optional
weight version, used by 2BW)::

    F3.1  B3.1  BI3.1  BW3.1          compute: forward, backward, backward split into input/weight grads
    SEND_F3.1>2   RECV_F3.1<0         activation sent to / received from rank q, for F3.1
    SEND_B3.1>0   RECV_B3.1<2         input-gradient sent from B3.1 (or BI3.1) / output-gradient for it
    OFFLOAD3.1    RELOAD3.1           stash of (3, 1) to host memory and back
    EVICT3.1>2    LOAD3.1<2           stash of (3, 1) parked on rank q and fetched back (BPipe)
    ACCEPT3.1<0   RETURN3.1>0         on the acceptor q: receive rank 0's evicted stash (3, 1) into new
                                      buffers, and send it back (mb and chunk name the evictor's stash)
    REDUCE_GRAD.1                     data-parallel gradient reduction of chunk 1
    STEP                              optimizer step
    F3.1@1                            any of the above with weight version 1

Communication actions name the local compute action they serve, not the remote one: `RECV_F3.1<0`
receives the input of this rank's F3.1 from rank 0, whatever that rank's chunk index is.

**Batching rule.** Consecutive communication actions (SEND_F, RECV_F, SEND_B, RECV_B) in a rank's list
form one *batch*. On NCCL the executor posts its members together (`torch.distributed.batch_isend_irecv`)
and the batch completes as a unit; the validator proves the lists deadlock-free under that, the strictest
rule (on gloo each member is its own operation, see `core.p2p`). This is how a send and a receive that can go together are paired,
e.g. 1F1B's steady state posts `SEND_F7.0>1 RECV_B4.0<1` as one batch; the blocking-semantics deadlock
of rank r sending F while rank r+1 sends B cannot occur because each side's batch also holds the
receive the other side's send needs. Messages on a directed link (rank a -> rank b) are matched in the
order they are posted, whatever their kind, as NCCL does; the validator checks both ends agree.

BPipe's peer parking uses two more links per pair, each its own process group (`ParallelState.pair_groups`):
EVICT on the evictor matches ACCEPT on the acceptor, LOAD matches RETURN, in list order on both sides.
Each of these actions is a batch of its own (posted alone, on its own group), never part of a pipeline batch.
"""
from __future__ import annotations

import enum
import functools
import gc
import json
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, TypeVar


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rank, the index in its list and the action."""


class Op(str, enum.Enum):
    """Operations a pipeline rank can perform; the value is the text-form prefix."""

    F = "F"
    B = "B"
    BI = "BI"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OFFLOAD = "OFFLOAD"
    RELOAD = "RELOAD"
    EVICT = "EVICT"
    LOAD = "LOAD"
    ACCEPT = "ACCEPT"
    RETURN = "RETURN"
    REDUCE_GRAD = "REDUCE_GRAD"
    STEP = "STEP"

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.BI, Op.BW})
"""Operations that run model code and count as busy time."""
COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
"""Pipeline point-to-point operations; consecutive ones form a batch (see the module docstring)."""
SEND_OPS = frozenset({Op.SEND_F, Op.SEND_B})
TRANSFER_OPS = frozenset({Op.OFFLOAD, Op.RELOAD, Op.EVICT, Op.LOAD})
"""Stash movements (PipeOffload, BPipe); they ride their own streams, not the pipeline batches."""
RETURN_TRANSFER = {Op.OFFLOAD: Op.RELOAD, Op.EVICT: Op.LOAD}
"""Outbound stash transfer (the stash leaves device memory) -> the inbound one that brings it back."""
HOSTING_OPS = frozenset({Op.ACCEPT, Op.RETURN})
"""The acceptor's side of BPipe's parking: post the receive of a partner's evicted stash, send it back."""
PARTNER_OP = {Op.EVICT: Op.ACCEPT, Op.LOAD: Op.RETURN, Op.ACCEPT: Op.EVICT, Op.RETURN: Op.LOAD}
"""The action on the other rank of a parking pair that a parking action is matched with."""
SIDE_OPS = TRANSFER_OPS | HOSTING_OPS
"""Actions on side streams that cost the compute stream nothing (stash transfers and hosting)."""

# Which fields each operation carries. The direction character is part of the peer syntax: '>' for
# operations that push data to the peer, '<' for those that pull from it.
_WITH_PEER_OUT = frozenset({Op.SEND_F, Op.SEND_B, Op.EVICT, Op.RETURN})
_WITH_PEER_IN = frozenset({Op.RECV_F, Op.RECV_B, Op.LOAD, Op.ACCEPT})
_WITHOUT_MICROBATCH = frozenset({Op.REDUCE_GRAD, Op.STEP})

# Longest names first so that "BI" is not read as "B" followed by garbage.
_OP_NAMES = "|".join(sorted((op.value for op in Op), key=len, reverse=True))
_NUMBER = r"(?:0|[1-9][0-9]*)"
_ACTION_RE = re.compile(
    rf"(?P<op>{_OP_NAMES})(?P<mb>{_NUMBER})?(?:\.(?P<chunk>{_NUMBER}))?"
    rf"(?:(?P<dir>[<>])(?P<peer>{_NUMBER}))?(?:@(?P<version>{_NUMBER}))?"
)


_WANTED_FIELDS = {op: (op not in _WITHOUT_MICROBATCH, op is not Op.STEP, op in _WITH_PEER_OUT or op in _WITH_PEER_IN)
                  for op in Op}
"""Op -> whether it carries (microbatch, chunk, peer)."""


def positive_int(name: str, value: object) -> int:
    """`value` if it is an int >= 1 (bool refused: True as a size is a bug upstream), else a ValueError
    naming it: every generator checks its sizes (ranks, microbatches, chunks, steps) with this."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_index(name: str, value: object) -> None:
    # bool is an int subclass; True as a microbatch index is always a bug upstream.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True)
class Action:
    """One step of a rank's list. `chunk` is the LOCAL chunk index on the rank that runs the action."""

    op: Op
    microbatch: int | None = None
    chunk: int | None = None
    peer: int | None = None
    version: int | None = None

    def __post_init__(self) -> None:
        op = self.op
        if type(op) is not Op:
            op = Op(op)
            object.__setattr__(self, "op", op)
        # Built hundreds of thousands of times for a large schedule: one table lookup, the usual case (each
        # field a plain non-negative int exactly where the op wants one, no version) settled in one test, and
        # the field-by-field checks, with their messages, only when it fails.
        microbatch, chunk, peer = self.microbatch, self.chunk, self.peer
        wants = wants_microbatch, wants_chunk, wants_peer = _WANTED_FIELDS[op]
        if (((type(microbatch) is int and microbatch >= 0) if wants_microbatch else microbatch is None)
                and ((type(chunk) is int and chunk >= 0) if wants_chunk else chunk is None)
                and ((type(peer) is int and peer >= 0) if wants_peer else peer is None)
                and self.version is None):
            return
        for name, wanted, value in zip(("microbatch", "chunk", "peer"), wants, (microbatch, chunk, peer)):
            if value is None:
                if wanted:
                    raise ValueError(f"{op.value} needs a {name}")
            elif not wanted:
                raise ValueError(f"{op.value} takes no {name}, got {name}={value!r}")
            elif type(value) is not int or value < 0:
                _check_index(f"{op.value} {name}", value)
        if self.version is not None:
            _check_index(f"{op.value} version", self.version)

    def __str__(self) -> str:
        text = self.op.value
        if self.microbatch is not None:
            text += str(self.microbatch)
        if self.chunk is not None:
            text += f".{self.chunk}"
        if self.peer is not None:
            text += (">" if self.op in _WITH_PEER_OUT else "<") + str(self.peer)
        if self.version is not None:
            text += f"@{self.version}"
        return text

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of `str(action)`; raises ValueError naming `text` when it is not a valid action."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}")
        op = Op(match["op"])
        direction = match["dir"]
        if direction is not None and direction != (">" if op in _WITH_PEER_OUT else "<"):
            raise ValueError(f"cannot parse action {text!r}: {op.value} does not take '{direction}'")
        fields = {name: None if match[name] is None else int(match[name])
                  for name in ("mb", "chunk", "peer", "version")}
        try:
            return cls(op, fields["mb"], fields["chunk"], fields["peer"], fields["version"])
        except ValueError as err:
            raise ValueError(f"cannot parse action {text!r}: {err}") from None

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS


@dataclass
class Schedule:
    """Every rank's action list plus the placement of global stages on (rank, local chunk).

    `placement[k]` is where global stage k lives; stage k's successor is stage k+1, wherever that is.
    Megatron's interleaved placement puts stage c·p + r on (rank r, chunk c). Treat `placement` as
    read-only after construction (the reverse index is built once); use `dataclasses.replace` to change it.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    num_chunks: int
    placement: list[tuple[int, int]]
    actions: list[list[Action]]
    options: dict = field(default_factory=dict)
    _stage_at: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)
    _neighbour_ranks: dict[tuple[int, int], tuple[int | None, int | None]] = field(init=False, repr=False,
                                                                                  compare=False)

    def __post_init__(self) -> None:
        for name in ("num_ranks", "num_microbatches", "num_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"schedule {self.name!r}: {name} must be a positive int, got {value!r}")
        self.placement = [(int(rank), int(chunk)) for rank, chunk in self.placement]
        if len(self.placement) != self.num_ranks * self.num_chunks:
            raise ValueError(f"schedule {self.name!r}: placement has {len(self.placement)} stages, expected "
                             f"num_ranks * num_chunks = {self.num_ranks * self.num_chunks}")
        self._stage_at = {}
        for stage, (rank, chunk) in enumerate(self.placement):
            if not (0 <= rank < self.num_ranks and 0 <= chunk < self.num_chunks):
                raise ValueError(f"schedule {self.name!r}: stage {stage} placed on (rank {rank}, chunk {chunk}), "
                                 f"outside {self.num_ranks} ranks x {self.num_chunks} chunks")
            if (rank, chunk) in self._stage_at:
                raise ValueError(f"schedule {self.name!r}: stages {self._stage_at[rank, chunk]} and {stage} "
                                 f"both placed on (rank {rank}, chunk {chunk})")
            self._stage_at[rank, chunk] = stage
        # (rank, chunk) -> (rank of the previous stage, rank of the next stage), None where that stage is
        # missing or on the same rank: asked once per action by the communication pass and the validator.
        self._neighbour_ranks = {}
        for stage, (rank, chunk) in enumerate(self.placement):
            prev_rank = self.placement[stage - 1][0] if stage > 0 else None
            next_rank = self.placement[stage + 1][0] if stage + 1 < len(self.placement) else None
            self._neighbour_ranks[rank, chunk] = (None if prev_rank == rank else prev_rank,
                                                  None if next_rank == rank else next_rank)
        if len(self.actions) != self.num_ranks:
            raise ValueError(f"schedule {self.name!r}: {len(self.actions)} action lists for {self.num_ranks} ranks")
        self.actions = [list(rank_actions) for rank_actions in self.actions]

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.num_chunks

    def stage_of(self, rank: int, chunk: int) -> int:
        """Global stage held by `chunk` of `rank`."""
        try:
            return self._stage_at[rank, chunk]
        except KeyError:
            raise ValueError(f"schedule {self.name!r} has no chunk {chunk} on rank {rank}") from None

    def neighbour_ranks(self, rank: int, chunk: int) -> tuple[int | None, int | None]:
        """(rank holding the previous stage, rank holding the next stage) of (rank, chunk), each None when
        there is no such stage or it sits on the same rank (then tensors are handed over in memory)."""
        try:
            return self._neighbour_ranks[rank, chunk]
        except KeyError:
            self.stage_of(rank, chunk)  # raises the error naming the missing chunk
            raise

    def location(self, stage: int) -> tuple[int, int]:
        """(rank, local chunk) holding global `stage`."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"schedule {self.name!r} has no stage {stage} (it has {self.num_stages})")
        return self.placement[stage]

    def to_text(self) -> str:
        """Header lines, then one `rank R: ...` line per rank; `from_text` reads it back."""
        lines = [
            f"schedule: {self.name}",
            f"ranks: {self.num_ranks}",
            f"microbatches: {self.num_microbatches}",
            f"chunks: {self.num_chunks}",
            "placement: " + " ".join(f"{rank}.{chunk}" for rank, chunk in self.placement),
            "options: " + json.dumps(self.options, sort_keys=True),
        ]
        lines += [f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Parse `to_text` output. Blank lines and lines starting with '#' are ignored."""
        header: dict[str, str] = {}
        ranks: dict[int, list[Action]] = {}
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"schedule text line {lineno}: expected 'key: value', got {line!r}")
            key, value = key.strip(), value.strip()
            if key.startswith("rank "):
                try:
                    rank = int(key[len("rank "):])
                except ValueError:
                    raise ValueError(f"schedule text line {lineno}: bad rank in {key!r}") from None
                ranks[rank] = [Action.parse(token) for token in value.split()]
            elif key in ("schedule", "ranks", "microbatches", "chunks", "placement", "options"):
                header[key] = value
            else:
                raise ValueError(f"schedule text line {lineno}: unknown key {key!r}")
        missing = [k for k in ("schedule", "ranks", "microbatches", "chunks", "placement") if k not in header]
        if missing:
            raise ValueError(f"schedule text lacks {', '.join(missing)}")
        num_ranks = int(header["ranks"])
        if sorted(ranks) != list(range(num_ranks)):
            raise ValueError(f"schedule text has action lists for ranks {sorted(ranks)}, expected 0..{num_ranks - 1}")
        placement = []
        for token in header["placement"].split():
            rank, dot, chunk = token.partition(".")
            if not dot or not rank.isdigit() or not chunk.isdigit():
                raise ValueError(f"schedule text: bad placement entry {token!r}, expected RANK.CHUNK")
            placement.append((int(rank), int(chunk)))
        return cls(
            name=header["schedule"],
            num_ranks=num_ranks,
            num_microbatches=int(header["microbatches"]),
            num_chunks=int(header["chunks"]),
            placement=placement,
            actions=[ranks[r] for r in range(num_ranks)],
            options=json.loads(header.get("options", "{}")),
        )

    def format_table(self, per_row: int = 16, ops: Iterable[Op] | None = None) -> str:
        """ASCII table, one row per rank (wrapped every `per_row` actions), of the actions whose op is in
        `ops` (default: compute only). Used for the tables in the generators' docstrings."""
        shown = COMPUTE_OPS if ops is None else frozenset(ops)
        rows = [[str(a) for a in acts if a.op in shown] for acts in self.actions]
        width = max((len(t) for row in rows for t in row), default=1)
        label = len(f"rank {self.num_ranks - 1}")
        lines: list[str] = []
        longest = max((len(row) for row in rows), default=0)
        for start in range(0, max(longest, 1), per_row):
            if start:
                lines.append("")
            for r, row in enumerate(rows):
                cells = " ".join(t.ljust(width) for t in row[start:start + per_row])
                lines.append(f"{f'rank {r}'.ljust(label)} | {cells}".rstrip())
        return "\n".join(lines)


_Pass = TypeVar("_Pass", bound=Callable)


def whole_schedule_pass(function: _Pass) -> _Pass:
    """Decorator for a pass over every action of a schedule (communication insertion, validation,
    simulation): runs it with CPython's cyclic garbage collector paused, and resumed after if it was on.

    Such a pass makes a few container objects per action (actions, tuples, lists, dict entries) that stay
    alive until it returns, and none of them is part of a reference cycle: a schedule is lists of frozen
    actions. The collector (generational, CPython 3.11) scans the whole heap each time the surviving objects
    have grown by a quarter, so it rescans every object made so far again and again (22 full collections
    over building and simulating p = 32, m = 1024, v = 4) and finds nothing to free: a fifth to a third of
    that CPU time (docs/benchmarks.md). Reference counting frees everything as before; only the collection
    of cycles, which these passes do not make, waits for the pass to end.
    """
    @functools.wraps(function)
    def run(*args, **kwargs):
        if not gc.isenabled():  # paused already (a nested pass, or the caller's choice): leave it so
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()
    return run  # type: ignore[return-value]


def batches(actions: Sequence[Action]) -> list[tuple[int, int]]:
    """[start, end) index ranges of the communication batches in one rank's list (see the batching rule)."""
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(actions):
        if actions[i].op in COMM_OPS:
            j = i
            while j < len(actions) and actions[j].op in COMM_OPS:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans
