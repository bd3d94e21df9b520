"""Schedule registry: `--pipeline-schedule NAME` -> generator (and passes) -> communication -> validation.

A schedule is registered by name with a builder that returns the compute-level lists (a generator, or a
generator followed by passes such as offload or layered gradient reduction). `build_schedule` adds the
communication and validates, so everything it returns is runnable. Built-in schedules register at import;
plugins from outside the package call `register_schedule` the same way before arguments are parsed.

Builder signature: `builder(num_ranks, num_microbatches, **options)`, plus `num_chunks` as the third
positional argument when the schedule supports virtual stages. Options are the builder's keyword
arguments, so a misspelt option is an error naming the ones that exist.

Command-line flags for options are declared once with `register_option(name, flag, type, help)`; the
argument parser generates a flag for every registered option and `options_from_args` hands a schedule
exactly the options it accepts, rejecting a given flag that does not apply to the chosen schedule. A new
schedule therefore never edits the argument parser.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable

from megatron_pp.schedules.bpipe import add_bpipe, warn_unhidden_transfers
from megatron_pp.schedules.comm import insert_communication
from megatron_pp.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b
from megatron_pp.schedules.gis import gis, min_group_size
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.looped import looped_bfs
from megatron_pp.schedules.offload import add_offload
from megatron_pp.schedules.twobw import two_bw
from megatron_pp.schedules.validate import validate
from megatron_pp.schedules.zero_bubble import zb_h1, zb_h2
from megatron_pp.schedules.vshape import CHUNKS_PER_RANK, check_chunks, v_half, zb_v


@dataclass(frozen=True)
class ScheduleEntry:
    """One registered schedule."""

    name: str
    builder: Callable[..., Schedule]
    aliases: tuple[str, ...]
    supports_virtual: bool
    """Whether it accepts num_chunks > 1 (from --num-layers-per-virtual-pipeline-stage)."""
    description: str
    chunks_per_rank: int | None = None
    """Chunks per rank the schedule always uses (the V's 2), its default when no virtual-stage flag is given;
    None: 1, or what --num-layers-per-virtual-pipeline-stage says where supports_virtual."""

    @property
    def options(self) -> tuple[str, ...]:
        """Names of the keyword options the builder accepts."""
        skip = 3 if self.supports_virtual else 2
        params = list(inspect.signature(self.builder).parameters.values())[skip:]
        return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


@dataclass(frozen=True)
class ScheduleOption:
    """A builder keyword exposed as a command-line flag (shared by every schedule that accepts it)."""

    name: str
    flag: str
    type: type
    help: str


_OPTIONS: dict[str, ScheduleOption] = {}
_ENTRIES: dict[str, ScheduleEntry] = {}
_LOOKUP: dict[str, str] = {}  # name or alias -> canonical name


def register_schedule(name: str, builder: Callable[..., Schedule], *, aliases: tuple[str, ...] = (),
                      supports_virtual: bool, description: str, chunks_per_rank: int | None = None) -> None:
    """Make `name` (and `aliases`) available to `build_schedule` and `--pipeline-schedule`."""
    for key in (name, *aliases):
        if not isinstance(key, str) or not key or key != key.strip():
            raise ValueError(f"schedule names must be non-empty strings without surrounding spaces, got {key!r}")
        if key in _LOOKUP:
            raise ValueError(f"schedule name {key!r} is already registered (for {_LOOKUP[key]!r})")
    _ENTRIES[name] = ScheduleEntry(name, builder, tuple(aliases), supports_virtual, description, chunks_per_rank)
    for key in (name, *aliases):
        _LOOKUP[key] = name


def unregister_schedule(name: str) -> None:
    """Remove a schedule and its aliases (for plugins that re-register, and for tests)."""
    entry = get_schedule(name)
    del _ENTRIES[entry.name]
    for key in (entry.name, *entry.aliases):
        del _LOOKUP[key]


def get_schedule(name: str) -> ScheduleEntry:
    """The entry registered under `name` or one of its aliases."""
    if name not in _LOOKUP:
        known = ", ".join(list_schedules())
        raise ValueError(f"unknown --pipeline-schedule {name!r}; known: {known}")
    return _ENTRIES[_LOOKUP[name]]


def list_schedules() -> list[str]:
    """Every name `--pipeline-schedule` accepts (canonical names and aliases), sorted."""
    return sorted(_LOOKUP)


def registered_schedules() -> list[ScheduleEntry]:
    """One entry per registered schedule (aliases folded in), sorted by canonical name."""
    return [_ENTRIES[name] for name in sorted(_ENTRIES)]


def register_option(name: str, flag: str, type: type, help: str) -> None:
    """Declare the flag of builder keyword `name` (idempotent for an identical declaration)."""
    option = ScheduleOption(name, flag, type, help)
    if _OPTIONS.get(name, option) != option:
        raise ValueError(f"schedule option {name!r} is already registered as {_OPTIONS[name].flag}")
    _OPTIONS[name] = option


def schedule_options() -> list[ScheduleOption]:
    """Every registered schedule option, sorted by flag."""
    return sorted(_OPTIONS.values(), key=lambda o: o.flag)


def options_from_args(args: object, name: str) -> dict:
    """The options given on the command line (attributes that are not None) for schedule `name`.

    Raises ValueError naming the flag when a given option does not apply to that schedule.
    """
    entry = get_schedule(name)
    given = {o.name: getattr(args, o.name) for o in _OPTIONS.values() if getattr(args, o.name, None) is not None}
    for key in given:
        if key not in entry.options:
            raise ValueError(f"{_OPTIONS[key].flag} does not apply to --pipeline-schedule {name} "
                             f"(its options: {', '.join(_OPTIONS[o].flag for o in entry.options if o in _OPTIONS) or 'none'})")
    return given


def generate_schedule(name: str, num_ranks: int, num_microbatches: int, num_chunks: int = 1,
                      **options: object) -> Schedule:
    """The registered builder's compute-level lists (generator and its passes), checked for the sizes asked
    for, without communication or validation: what `build_schedule` starts from, and what a check that only
    needs the generator's refusals runs (the batch-size ramp-up's other microbatch counts). Raises
    ValueError."""
    entry = get_schedule(name)
    if num_chunks != 1 and not entry.supports_virtual:
        raise ValueError(f"pipeline schedule {entry.name!r} has no virtual stages, but {num_chunks} chunks per "
                         "rank were requested (--num-layers-per-virtual-pipeline-stage or "
                         "--num-virtual-stages-per-pipeline-rank); drop that flag or pick a schedule that supports it: "
                         + ", ".join(e.name for e in registered_schedules() if e.supports_virtual))
    sizes = (num_ranks, num_microbatches, num_chunks) if entry.supports_virtual else (num_ranks, num_microbatches)
    try:
        inspect.signature(entry.builder).bind(*sizes, **options)
    except TypeError as err:
        accepted = ", ".join(entry.options) or "none"
        raise ValueError(f"pipeline schedule {entry.name!r} rejects options {sorted(options)} ({err}); "
                         f"its options: {accepted}") from None
    schedule = entry.builder(*sizes, **options)
    got = (schedule.num_ranks, schedule.num_microbatches, schedule.num_chunks)
    # A schedule that unrolls several optimizer steps (2BW's `steps`) numbers microbatches across them.
    if got != (num_ranks, num_microbatches * schedule.options.get("steps", 1), num_chunks):
        raise ValueError(f"builder of {entry.name!r} returned a schedule for (ranks, microbatches, chunks) = "
                         f"{got}, asked for {(num_ranks, num_microbatches, num_chunks)}")
    return dataclasses.replace(schedule, name=entry.name)


def build_schedule(name: str, num_ranks: int, num_microbatches: int, num_chunks: int = 1,
                   **options: object) -> Schedule:
    """Generator -> communication pass -> validation. Raises ValueError (ScheduleError for rule breaks)."""
    schedule = insert_communication(generate_schedule(name, num_ranks, num_microbatches, num_chunks, **options))
    validate(schedule)
    return schedule


def build_at_nominal_size(name: str, num_ranks: int, **options: object) -> Schedule:
    """Schedule `name` for `num_ranks` ranks at a size every built-in accepts (2p microbatches, 2 chunks
    where it takes virtual stages): for checks that read what its lists contain (`runtime.runtime_needs`),
    which does not depend on their length. Raises what `build_schedule` raises."""
    entry = get_schedule(name)
    chunks = entry.chunks_per_rank or (2 if entry.supports_virtual else 1)
    return build_schedule(entry.name, num_ranks, 2 * num_ranks, chunks, **options)


def stage_placement(name: str, num_ranks: int, num_chunks: int) -> list[tuple[int, int]]:
    """Where schedule `name` puts the global stages of `num_ranks` ranks x `num_chunks` chunks: (rank, chunk)
    per stage, read from the schedule built at 2p microbatches (placement does not depend on m). Most
    schedules interleave (stage g on rank g mod p); the V shapes put stages r and 2p-1-r on rank r. For
    tools that lay out weights for a run (checkpoint conversion). Raises what `build_schedule` raises."""
    entry = get_schedule(name)
    if not entry.supports_virtual:
        if num_chunks != 1:
            build_schedule(entry.name, num_ranks, 2 * num_ranks, num_chunks)  # refused, with the flag named
        return build_schedule(entry.name, num_ranks, 2 * num_ranks).placement
    return build_schedule(entry.name, num_ranks, 2 * num_ranks, num_chunks).placement


def _interleaved(num_ranks: int, num_microbatches: int, num_chunks: int,
                 microbatch_group_size: int | None = None) -> Schedule:
    # Megatron's config name for the group size, so the flag reads the same as there.
    return interleaved_1f1b(num_ranks, num_microbatches, num_chunks, group_size=microbatch_group_size)


def _one_f_one_b(num_ranks: int, num_microbatches: int, offload_chunks: int | None = None,
                 offload_fraction: float | None = None, offload_time: float | None = None) -> Schedule:
    # PipeOffload's Appendix A: every rank but the last two offloads; their stashes live too briefly.
    return add_offload(one_f_one_b(num_ranks, num_microbatches), offload_chunks, offload_fraction=offload_fraction,
                       offload_time=offload_time, ranks=range(num_ranks - 2))


def _gis(num_ranks: int, num_microbatches: int, num_chunks: int, interleave_group_size: int | None = None,
         offload_chunks: int | None = None, offload_fraction: float | None = None,
         offload_time: float | None = None) -> Schedule:
    return add_offload(gis(num_ranks, num_microbatches, num_chunks, interleave_group_size), offload_chunks,
                       offload_fraction=offload_fraction, offload_time=offload_time)


def _gis_h(num_ranks: int, num_microbatches: int, num_chunks: int, offload_chunks: int | None = None,
           offload_fraction: float | None = None, offload_time: float | None = None) -> Schedule:
    return _gis(num_ranks, num_microbatches, num_chunks, min_group_size(num_ranks), offload_chunks,
                offload_fraction, offload_time)


def _po_h(num_ranks: int, num_microbatches: int, num_chunks: int, offload_time: float | None = None) -> Schedule:
    return _gis(num_ranks, num_microbatches, num_chunks, 1, offload_fraction=0.5, offload_time=offload_time)


def _po_f(num_ranks: int, num_microbatches: int, num_chunks: int, offload_time: float | None = None) -> Schedule:
    return _gis(num_ranks, num_microbatches, num_chunks, 1, offload_chunks=num_chunks, offload_time=offload_time)


register_option("microbatch_group_size", "--microbatch-group-size-per-vp-stage", int,
                "Interleaved 1F1B: microbatches per chunk group (default pp, depth-first; m gives breadth-first).")
register_option("interleave_group_size", "--interleave-group-size", int,
                "GIS: microbatches per group, ceil(pp/2)..pp (default pp; ceil(pp/2) is GIS-H) or 1 for the "
                "uniform repeating order of PipeOffload.")
register_option("offload_chunks", "--offload-chunks", int,
                "Offload the stashes of each rank's first K chunks to host memory (PipeOffload; 1f1b: K=1 on "
                "every rank but the last two).")
register_option("offload_fraction", "--offload-fraction", float,
                "Offload ceil(fraction x chunks per rank) chunks instead of --offload-chunks (0.5 = PO-H).")
register_option("offload_time", "--offload-time", float,
                "One-way transfer time of one chunk's stash in units of that chunk's forward time, used to place "
                "the copies (default 0.25; measure with benchmarks/bench_offload.py).")
register_schedule("gpipe", gpipe, supports_virtual=False,
                  description="all forwards, then all backwards; m stashes on every rank")
register_schedule("1f1b", _one_f_one_b, aliases=("pipedream-flush",), supports_virtual=False,
                  description="1F1B with flush (PipeDream-Flush, Megatron default); rank s holds p-s stashes")
register_schedule("interleaved-1f1b", _interleaved, supports_virtual=True,
                  description="Megatron's interleaved 1F1B over v chunks per rank; bubble (p-1)/(v*m+p-1)")
register_schedule("gis", _gis, supports_virtual=True,
                  description="PipeOffload's generalized interleaved 1F1B (split backward, shorter warm-up); rank 0 "
                              "holds g(v-1)+p chunk stashes; g=1 is the uniform repeating order")
register_schedule("gis-h", _gis_h, supports_virtual=True,
                  description="GIS with group size ceil(p/2): about half of interleaved 1F1B's memory")
register_schedule("po-h", _po_h, supports_virtual=True,
                  description="uniform repeating order, first ceil(v/2) chunks of every rank offloaded to host")
register_schedule("po-f", _po_f, supports_virtual=True,
                  description="uniform repeating order, every chunk offloaded to host (a few layers resident)")


def _bpipe(num_ranks: int, num_microbatches: int, bpipe_max_resident: int | None = None) -> Schedule:
    return warn_unhidden_transfers(add_bpipe(one_f_one_b(num_ranks, num_microbatches), bpipe_max_resident))


register_option("bpipe_max_resident", "--bpipe-max-resident", int,
                "BPipe: stashes each rank keeps in device memory before parking the newest on its partner "
                "p-1-x (default ceil((pp+2)/2)).")
register_schedule("bpipe", _bpipe, supports_virtual=False,
                  description="1F1B with BPipe: rank x parks stashes above K=ceil((p+2)/2) on rank p-1-x; "
                              "every rank peaks at K+1 or less")


register_option("breadth_first_microbatches", "--breadth-first-microbatches", int,
                "looped-bfs: microbatches per breadth-first group (default: all m of the step); the step runs "
                "m/B such groups one after the other, bounding activation memory by B. At least pp.")
register_option("layered_grad_accumulation", "--layered-grad-accumulation", bool,
                "looped-bfs: reduce each chunk's gradients over data parallelism right after its last backward of "
                "each breadth-first group (REDUCE_GRAD), overlapping the backward of the chunks below it.")
register_option("checkpoint_layer_inputs", "--checkpoint-layer-inputs", bool,
                "looped-bfs: keep only each layer's input and recompute the layer in the backward (default on; "
                "--no-checkpoint-layer-inputs keeps every activation; --recompute-granularity overrides it).")
register_schedule("looped-bfs", looped_bfs, aliases=("modular",), supports_virtual=True,
                  description="modular (looping) pipeline, stage k on rank k mod p, breadth-first: all forwards of "
                              "a chunk, then the next; bubble (p-1)/(v*m+p-1); needs m >= p")
register_schedule("2bw", two_bw, supports_virtual=False,
                  description="PipeDream-2BW: 1F1B with no flush between steps, two weight versions, "
                              "W(t+1) = W(t) - lr*g(W(t-1)); needs m >= p (option steps: unroll several steps)")


def _zero_bubble(generator):
    # Offload as for 1F1B, but on every rank: BW trailing BI keeps even the last ranks' stashes alive for
    # several backwards, and the pass leaves a stash in place where its gap is too short to hide the copies.
    def builder(num_ranks: int, num_microbatches: int, offload_chunks: int | None = None,
                offload_fraction: float | None = None, offload_time: float | None = None) -> Schedule:
        return add_offload(generator(num_ranks, num_microbatches), offload_chunks, offload_fraction=offload_fraction,
                           offload_time=offload_time)
    return builder


register_schedule("zb-h1", _zero_bubble(zb_h1), supports_virtual=False,
                  description="zero-bubble ZB-H1 (split backward, BW trailing BI by r on rank r): bubble "
                              "(p-1)(T_F+T_B-T_W), every rank holds p stashes (1F1B's rank-0 peak)")
register_schedule("zb-h2", _zero_bubble(zb_h2), supports_virtual=False,
                  description="zero-bubble ZB-H2 (longer warm-up, BW filling the tail): no gap between a rank's "
                              "first F and last BW for m >= 2p-1; every rank holds 2p-1 stashes")


def _v_shape(generator: Callable[[int, int], Schedule], name: str) -> Callable[..., Schedule]:
    """Builder of a V-shape schedule (schedules/vshape.py): two chunks per rank, host offload from chunk 0 up
    (the V's first chunk lives longest), BPipe refused."""
    def build(num_ranks: int, num_microbatches: int, num_chunks: int, offload_chunks: int | None = None,
              offload_fraction: float | None = None, offload_time: float | None = None,
              bpipe_max_resident: int | None = None) -> Schedule:
        check_chunks(name, num_chunks)
        if bpipe_max_resident is not None:
            raise ValueError(f"--bpipe-max-resident does not apply to --pipeline-schedule {name}: the V placement "
                             "already gives every rank the same peak (stages r and 2p-1-r, BPipe's pair, share "
                             "rank r), so there is nothing to park on a partner; use --offload-chunks instead")
        return add_offload(generator(num_ranks, num_microbatches), offload_chunks, offload_fraction=offload_fraction,
                           offload_time=offload_time)
    return build


register_schedule("zb-v", _v_shape(zb_v, "zb-v"), supports_virtual=True, chunks_per_rank=CHUNKS_PER_RANK,
                  description="ZB-V: two chunks per rank in V placement (stages r and 2p-1-r on rank r), split "
                              "backward; 1F1B's peak memory (2p chunk stashes), idle (p-1) T_F per rank")
register_schedule("v-half", _v_shape(v_half, "v-half"), supports_virtual=True, chunks_per_rank=CHUNKS_PER_RANK,
                  description="V placement within the V-Half memory (2*ceil((p+2)/2) chunk stashes, 1F1B: 2p): "
                              "about half of 1F1B's idle time; assumes equal F, BI and BW times")
