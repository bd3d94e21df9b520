"""The dry run: the job's real code for chosen ranks of a world of any size, on fake tensors, in one process.

`--dry-run N` runs what `pretrain` runs on one rank -- argument validation (with world size N), the process
groups (on torch's `fake` backend, whose collectives return at once), the job's schedule and action list,
`build_pipeline`, the optimizer and its gradient reducer, and two training steps (so Adam's state exists) --
under `FakeTensorMode`: every tensor has its shape, dtype and device but no storage, autograd runs, and
nothing is allocated for real. The chosen ranks run one after another; each gets a fresh fake world.

What is counted comes from live storages, not from a formula: `MemoryTracker` sees every operator's
outputs (a `TorchDispatchMode` above the fake mode), adds each new storage's bytes once (by
`core.storage.storage_key`) and subtracts them when the storage dies. The saved-activation peak is the
executor's own store's (`ActivationStore.peak_bytes`), exactly what a real run reports. Parameters,
gradients (the reducer's buffers) and optimizer state (Adam's moments, fp32 main weights) are the storages
those objects hold. The total peak is the largest live total, and `peak_at` names the action (or the
optimizer step) running when it was reached. What the dry run cannot see (allocator rounding, NCCL and
CUDA context, library workspaces) is listed in docs/dry_run.md.

Worked example: `python pretrain_llama.py --model-preset llama3-70b --tensor-model-parallel-size 8
--pipeline-model-parallel-size 8 --micro-batch-size 1 --global-batch-size 16 --seq-length 4096 --bf16
--dry-run 64` runs 8 ranks (one per pipeline rank: the tp positions of a stage hold equal shards).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
import weakref
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_pp.core import comm
from megatron_pp.core.comm_check import CommEvent, CommWatch, fake_world
from megatron_pp.core.grads import unique_parameters
from megatron_pp.core.parallel_state import ParallelState, RankLayout
from megatron_pp.core.storage import storage_key
from megatron_pp.schedules.peer_store import AcceptorStore, PeerStore
from megatron_pp.training.arguments import build_job_schedule, num_chunks, virtual_stages_given
from megatron_pp.training.dry_run_bpipe import Prepare, acceptor_prepare
from megatron_pp.training.dry_run_fast import FastFakeDispatch, supported as dry_run_fast_supported
from megatron_pp.training.dry_run_twobw import TwoBWCalls
from megatron_pp.training.layered import connect_optimizer
from megatron_pp.training.optimizer import OptimizerConfig, build_optimizer
from megatron_pp.training.pipeline import build_job_pipeline, connect_param_gather
from megatron_pp.training.step import step_metrics, train_step
from megatron_pp.training.step_data import build_config_and_data


_DEVICE_OF = torch.ops.prim.device.default
_HOLDS_A_STORAGE = {torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class _LiveBytes:
    """Live bytes of every storage an operator made, its peak and where the peak fell.

    `where` is set by the caller (the action running); `peak_at` keeps the `where` of the peak. A storage
    is counted once however many views of it exist, and stops counting when it dies (a weak reference with a
    callback: PyTorch keeps one Python object per live storage, so it dies exactly with the storage).
    Storages made while `host_side` is set (PipeOffload's host buffers: on a CPU job the host and the
    "device" are one device type, so the allocation site tells them apart) count as host memory, apart from
    the device's; storages named by `mark_guests` (BPipe's buffers for a partner's parked stash) stay in the
    device's count and are also counted apart."""

    def _start(self, watch: Optional[CommWatch]) -> None:
        # Shown every operator before it runs, so the communication watch needs no dispatch layer of its own.
        self.watch = watch
        self.live: dict[int, tuple[weakref.ref, int, bool]] = {}  # storage_key -> (weak ref, nbytes, on host)
        self.live_bytes = self.peak_bytes = 0
        self.peak_at = ""
        self.where = "setup"
        self.on_peak = None
        self.host_side = False
        self.host_bytes = self.host_peak_bytes = 0
        self.guest_bytes = self.guest_peak_bytes = 0
        self._guests: set[int] = set()

    def _note(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata  # core.storage.storage_key, inlined: this runs for every operator's outputs
        if key in self.live:
            return  # the same live storage (a view, an in-place result): a dead one's callback removed it
        nbytes = storage.nbytes()
        self.live[key] = (weakref.ref(storage, lambda ref, key=key: self._freed(key, ref)), nbytes, self.host_side)
        if self.host_side:
            self.host_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
            return
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_at = self.live_bytes, self.where
            if self.on_peak is not None:
                self.on_peak()

    def _freed(self, key: int, ref: weakref.ref) -> None:
        entry = self.live.get(key)
        if entry is not None and entry[0] is ref:
            del self.live[key]
            if entry[2]:
                self.host_bytes -= entry[1]
            else:
                self.live_bytes -= entry[1]
            if key in self._guests:
                self._guests.discard(key)
                self.guest_bytes -= entry[1]

    def mark_guests(self, tensors) -> None:
        """Count the live storages of `tensors` as hosted for a partner (still device memory)."""
        for t in tensors:
            key = t.untyped_storage()._cdata
            if key in self.live and key not in self._guests:
                self._guests.add(key)
                self.guest_bytes += self.live[key][1]
        self.guest_peak_bytes = max(self.guest_peak_bytes, self.guest_bytes)

    def _seen(self, out) -> None:
        if isinstance(out, torch.Tensor):
            self._note(out)
        elif isinstance(out, (list, tuple)):
            for t in _tensors(out):
                self._note(t)


class MemoryTracker(_LiveBytes, TorchDispatchMode):
    """`_LiveBytes` as a dispatch mode of its own, for real tensors (the test that holds the dry run to a
    real run of the same code uses it)."""

    def __init__(self, watch: Optional[CommWatch] = None) -> None:
        TorchDispatchMode.__init__(self)
        self._start(watch)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.watch is not None:
            self.watch.observe(func, args)
        out = func(*args, **(kwargs or {}))
        self._seen(out)
        return out


class TrackingFakeMode(_LiveBytes, FastFakeDispatch):
    """`FakeTensorMode` that is also the memory tracker and the communication watch: one Python dispatch
    layer per operator instead of three (a second mode stacked on the fake one cost ~50 us per operator, as
    much as a cached fake dispatch itself; benchmarks/dry_run_profile.py). Only the operators the job calls
    are counted, not those the fake mode runs inside itself (decompositions), as a mode stacked above it saw.
    `fast` (default on): the cheaper cache key and bypass of `dry_run_fast`, same outputs."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Torch wraps a dispatch mode's `__torch_dispatch__` in a dynamo-disable frame (two more Python calls
        # per operator) unless the mode opts out here; the dry run compiles nothing (`--apply-rope-fusion`
        # is the training loop's, not the dry run's), so on the torch of `dry_run_fast` it opts out.
        return not dry_run_fast_supported()

    def __init__(self, watch: Optional[CommWatch] = None, fast: bool = True) -> None:
        # Host tensors the job keeps for real (RNG states, cloned for recomputation) may meet fake ones.
        FastFakeDispatch.__init__(self, fast=fast, allow_non_fake_inputs=True)
        self._start(watch)
        self._inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_OF and isinstance(args[0], FakeTensor):
            # `tensor.device` (about half of all operators: autograd asks it of every gradient), answered as
            # the fake mode's own handler answers it, without its dispatch machinery.
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        if self._inside:  # an operator the fake mode runs for one of the job's
            return self.fake_dispatch(func, types, args, kwargs or {})
        if self.watch is not None:
            self.watch.observe(func, args)
        self._inside = True
        # `set_(storage, ...)` (the offload and BPipe stores rebuild views on a storage with it) is kept out of
        # the fake mode's dispatch cache: its key would hold the storage, which then never dies (on the tiny
        # PipeOffload run, 8 MiB of stashes stayed live and the peak was 2.8x the real run's).
        cached, self.cache_enabled = self.cache_enabled, self.cache_enabled and func not in _HOLDS_A_STORAGE
        try:
            out = self.fake_dispatch(func, types, args, kwargs or {})
        finally:
            self._inside, self.cache_enabled = False, cached
        self._seen(out)
        return out


def _bytes_of(tensors) -> int:
    """Bytes of the distinct storages of `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass
class RankReport:
    """What one simulated rank holds (bytes) and where its peak fell."""

    rank: int
    pipeline_rank: int
    tensor_rank: int
    data_rank: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    stash_peak_bytes: int
    transient_peak_bytes: int
    peak_bytes: int
    peak_at: str
    seconds: float
    """CPU seconds of the whole rank (process time): groups, model, optimizer, the steps."""
    host_bytes: int = 0
    """Host memory (PipeOffload's host buffers, pinned on CUDA) live at the end of the second step: the pool
    keeps its buffers across steps, so this is what the job holds on the host from then on."""
    host_peak_bytes: int = 0
    """The most host memory live at once (not in `peak_bytes`, which is the device's)."""
    guest_peak_bytes: int = 0
    """BPipe acceptor: the most device memory held at once for the partner's parked stashes (in `peak_bytes`)."""
    guest_at_peak_bytes: int = 0
    """BPipe acceptor: of `peak_bytes`, the partner's parked stashes (neither state, own stash nor transient)."""
    optimizer_implementation: str = ""
    """The optimizer the rank built (`TrainingOptimizer.implementation`), e.g. 'torch.optim.AdamW (fused)'."""
    step_seconds: list[float] = field(default_factory=list)
    """CPU seconds of each step (forward, backward and reduction through the executor, then the optimizer)."""
    comm: list[CommEvent] = field(default_factory=list, repr=False)

    def row(self) -> dict:
        out = asdict(self)
        out.pop("comm")
        out["collectives"] = sum(1 for e in self.comm if not e.is_p2p)
        out["p2p"] = sum(1 for e in self.comm if e.is_p2p)
        return out


def default_ranks(world: int, tp: int, pp: int) -> list[int]:
    """One global rank per (pipeline rank, tp position) that can differ. Tensor-parallel shards are equal
    in size on every tp position unless the vocabulary or heads divide unevenly, which validation refuses, so
    one tp position per pipeline rank stands for all; dp replicas are identical too (their optimizer shards
    differ by at most one bucket element, which the distributed optimizer pads). Worked example: world 64,
    tp 8, pp 8 -> the ranks of dp 0, tp 0 on pipeline ranks 0..7."""
    layout = RankLayout(world, tp, pp)
    return sorted({min(r for r in range(world) if layout.coords(r).pp == p and layout.coords(r).tp == 0
                       and layout.coords(r).dp == 0) for p in range(pp)})


def chosen_ranks(args: argparse.Namespace) -> list[int]:
    world = args.dry_run
    if args.dry_run_ranks in (None, ""):
        return default_ranks(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if args.dry_run_ranks == "all":
        return list(range(world))
    return sorted({int(r) for r in args.dry_run_ranks.split(",")})


def _label_actions(executor, tracker: _LiveBytes, step: list[int]) -> None:
    """Make the tracker name the running action ("step 2, #17 B3.0") for the peak's position."""
    counter = [0]
    for op, handler in list(executor.handlers.items()):
        def labelled(action, run=handler):
            counter[0] += 1
            tracker.where = f"step {step[0]}, {action}"
            run(action)
        executor.handlers[op] = labelled


def _watch_host_side(store, tracker: _LiveBytes) -> None:
    """Point the tracker at the store's host-side memory: PipeOffload's host buffers (allocated by its
    `HostBufferPool.take`) count as host memory; BPipe's acceptor buffers (allocated by `accept`) as hosted."""
    pool = getattr(store, "pool", None)
    if pool is not None and not isinstance(store, PeerStore):  # a PeerStore records, it copies nothing to host
        take = pool.take

        def take_on_host(nbytes: int, take=take) -> torch.Tensor:
            tracker.host_side = True
            try:
                return take(nbytes)
            finally:
                tracker.host_side = False
        pool.take = take_on_host
    if isinstance(store, AcceptorStore):
        accept = store.accept

        def accept_counted(key, accept=accept) -> None:
            accept(key)
            tracker.mark_guests(store._guests[key])
        store.accept = accept_counted


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Adam's moments and the fp32 main weights where they are copies (bf16/fp16 models)."""
    inner = getattr(optimizer, "optimizer", None)
    found = [t for s in (inner.state.values() if inner is not None else ()) for t in s.values()
             if isinstance(t, torch.Tensor) and t.numel() > 1]
    main = getattr(optimizer, "main", None)
    found += [p for p in getattr(main, "params", []) or []]
    return found


def _not_in(tensors, others) -> list[torch.Tensor]:
    """`tensors` whose storage is none of `others`' (fp32 models train their parameters as main weights)."""
    keys = {storage_key(t) for t in others}
    return [t for t in tensors if storage_key(t) not in keys]


def run_rank(args: argparse.Namespace, rank: int, device: torch.device, steps: int = 2,
             prepare: Optional[Prepare] = None) -> RankReport:
    """The job's code on global rank `rank` of a world of `args.dry_run`, on fake tensors. `prepare(pipe)` runs
    once the pipeline is built; by default a BPipe acceptor's, which first dry-runs its partner (dry_run_bpipe)."""
    world, started = args.dry_run, time.process_time()
    if prepare is None:
        prepare = acceptor_prepare(args, rank, lambda partner, stop: run_rank(args, partner, device, 1, stop))
    with fake_world(rank, world, device.type):
        watch = CommWatch(device=device if device.type == "meta" else None)
        mode = TrackingFakeMode(watch, fast=getattr(args, "dry_run_fast_dispatch", True))
        with mode:
            state = ParallelState.build(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                        device=device)
            report = _run(args, state, mode, mode, steps, prepare)
        report.comm = watch.events
        report.seconds = time.process_time() - started
        return report


def _optimizer_config(args, device: torch.device) -> OptimizerConfig:
    """The job's optimizer, with the AdamW kernel the job's GPU builds (`--dry-run-optimizer`, default fused):
    the fake tensors are on the CPU, where the job's own choice would be foreach AdamW, whose step holds
    sqrt(v) of a whole parameter group (4 bytes a parameter) that the fused kernel never allocates. On the
    meta device torch's fused AdamW refuses the parameters (it checks their device type), so a meta dry run
    builds foreach; `RankReport.optimizer_implementation` says which ran."""
    wanted = getattr(args, "dry_run_optimizer", None) or "fused"
    return dataclasses.replace(OptimizerConfig.from_args(args),
                               adam_implementation="foreach" if device.type == "meta" else wanted)


def _run(args, state: ParallelState, mode: Optional[FakeTensorMode], tracker: _LiveBytes,
         steps: int, prepare: Optional[Prepare] = None) -> RankReport:
    """Build and run the rank's job inside the tracker (and, for the dry run, the fake mode). With `mode`
    None the same code runs on real tensors: the test that holds the dry run to a real run uses that."""
    from megatron_pp.core.tensor_parallel import model_parallel_seed

    model_parallel_seed(args.seed, state.tp_rank, state.pp_rank)
    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # data and lists are host work, for real
        config, data = build_config_and_data(args, state)
        shape = config
        chunks = num_chunks(args, shape) if virtual_stages_given(args) or not args.pipeline_schedule_file else None
        schedule = build_job_schedule(args, state.dp_size, chunks)
        batches_real = data.microbatches(data.train, 0, state.dp_rank, torch.device("cpu"))
    pipe = build_job_pipeline(args, config, state, schedule)
    if prepare is not None:
        prepare(pipe)
    adam = _optimizer_config(args, state.device)
    # 2BW: one optimizer state over two weight versions, calls that span steps (dry_run_twobw)
    two_bw = TwoBWCalls(args, pipe, adam, data, batches_real) if pipe.versions is not None else None
    optimizer = two_bw.optimizer if two_bw is not None else build_optimizer(pipe.chunks, state, adam)
    connect_optimizer(pipe.executor, optimizer)
    connect_param_gather(args, pipe, optimizer)  # --overlap-param-gather: gathers held until each chunk's forward
    to_job = (lambda t: mode.from_tensor(t).to(state.device)) if mode is not None else (lambda t: t.to(state.device))
    batches = [{k: to_job(v) if isinstance(v, torch.Tensor) else v for k, v in mb.items()} for mb in batches_real]
    del batches_real
    step = [0]
    _label_actions(pipe.executor, tracker, step)
    _watch_host_side(pipe.executor.store, tracker)
    at_peak = [0, 0]  # the store's own stashes and the partner's hosted ones when the peak was reached
    tracker.on_peak = lambda: at_peak.__setitem__(slice(None), [pipe.executor.store.live_bytes, tracker.guest_bytes])
    step_seconds = []
    for step[0] in range(1, steps + 1) if two_bw is None else ():
        began = time.process_time()
        result, tokens = train_step(pipe, batches, optimizer)
        tracker.where = f"step {step[0]}, optimizer"
        optimizer.step(args.lr)
        step_metrics(pipe, result, tokens)  # the logged loss: the step's other read
        step_seconds.append(time.process_time() - began)
    if two_bw is not None:
        step_seconds = two_bw.run(batches, step, steps)
    weights, more_grads, more_opt = two_bw.extra_state() if two_bw is not None else ([], [], [])
    model_params = list(unique_parameters(pipe.chunks)) + weights
    params = _bytes_of(model_params)
    grads = _bytes_of([b.grad for b in optimizer.reducer.buckets] + more_grads)
    opt = _bytes_of(_not_in(_optimizer_tensors(optimizer) + more_opt, model_params))
    persistent = params + grads + opt
    return RankReport(
        rank=state.rank, pipeline_rank=state.pp_rank, tensor_rank=state.tp_rank, data_rank=state.dp_rank,
        parameter_bytes=params, gradient_bytes=grads, optimizer_bytes=opt,
        stash_peak_bytes=pipe.executor.store.peak_bytes,
        transient_peak_bytes=max(tracker.peak_bytes - persistent - at_peak[0] - at_peak[1], 0),
        peak_bytes=tracker.peak_bytes, peak_at=tracker.peak_at, seconds=0.0, step_seconds=step_seconds,
        host_bytes=tracker.host_bytes, host_peak_bytes=tracker.host_peak_bytes,
        guest_peak_bytes=tracker.guest_peak_bytes, guest_at_peak_bytes=at_peak[1],
        optimizer_implementation=getattr(optimizer, "implementation", ""))


# The command ---------------------------------------------------------------------------------------------
_COLUMNS = (("rank", "rank"), ("pp", "pipeline_rank"), ("tp", "tensor_rank"), ("params", "parameter_bytes"),
            ("grads", "gradient_bytes"), ("optimizer", "optimizer_bytes"), ("stash peak", "stash_peak_bytes"),
            ("transient", "transient_peak_bytes"), ("peak", "peak_bytes"), ("host peak", "host_peak_bytes"),
            ("hosted peak", "guest_peak_bytes"))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    """The per-rank table the command prints (MiB; `peak at` is the action running at the peak)."""
    head = [name for name, _ in _COLUMNS] + ["peak at"]
    body = [[str(r[k]) if k in ("rank", "pipeline_rank", "tensor_rank") else _mib(r[k]) for _, k in _COLUMNS]
            + [r["peak_at"]] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head) + "   (MiB)"] + [fmt(b) for b in body])


def default_jobs(ranks: int) -> int:
    """`--dry-run-jobs` left out: one worker per core this process may use, at most one per rank."""
    return max(1, min(len(os.sched_getaffinity(0)), ranks))


def _rank_in_worker(args: argparse.Namespace, rank: int) -> RankReport:
    # A spawned worker starts with the registry bare: load the job's plugins (parse_args did, in the parent).
    from megatron_pp.schedules.plugins import load_plugins

    load_plugins(extra=getattr(args, "schedule_plugin", None) or ())
    return run_rank(args, rank, torch.device(args.dry_run_device))


def run_ranks(args: argparse.Namespace, ranks: list[int], jobs: Optional[int] = None,
              on_report: Callable[[RankReport], None] = lambda report: None) -> list[RankReport]:
    """Dry-run `ranks` in `jobs` worker processes (default `default_jobs`; 1: in this process, one after
    another), reports in the order of `ranks`. The ranks are independent (each gets a fresh fake world), so
    workers divide the wall clock; every worker returns its ranks' recorded calls, and the caller matches them
    across all ranks (`dry_run_agree`). `on_report` sees each report as it arrives (a long run that is stopped
    keeps what it measured). Workers are spawned, not forked: the parent's torch state is not theirs."""
    jobs = default_jobs(len(ranks)) if jobs is None else jobs
    if jobs <= 1 or len(ranks) <= 1:
        reports = []
        for rank in ranks:
            reports.append(run_rank(args, rank, torch.device(args.dry_run_device)))
            on_report(reports[-1])
        return reports
    done: dict[int, RankReport] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_rank_in_worker, args, rank): rank for rank in ranks}
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            on_report(done[futures[future]])
    return [done[rank] for rank in ranks]


def dry_run(args: argparse.Namespace) -> tuple[list[RankReport], list[str]]:
    """Run the chosen ranks (`--dry-run-jobs` worker processes); the reports and the cross-rank
    disagreements over every simulated rank."""
    from megatron_pp.training.dry_run_agree import disagreements

    reports = run_ranks(args, chosen_ranks(args), getattr(args, "dry_run_jobs", None))
    return reports, disagreements({r.rank: r.comm for r in reports})


def main(args: argparse.Namespace) -> int:
    """`pretrain_*.py ... --dry-run N`: print the table, write `--dry-run-json`; 0, or 1 when ranks disagree."""
    if comm.backend_name() != "none":
        print("error: --dry-run runs in one process: do not launch it with torchrun or srun")
        return 2
    reports, problems = dry_run(args)
    rows = [r.row() for r in reports]
    print(f"dry run: world {args.dry_run} = tp {args.tensor_model_parallel_size} x pp "
          f"{args.pipeline_model_parallel_size} x dp {args.dry_run // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)}, "
          f"schedule {args.pipeline_schedule}, {len(rows)} ranks simulated, fake tensors on {args.dry_run_device}")
    print(table(rows))
    for line in problems:
        print(f"disagreement: {line}")
    if args.dry_run_json:
        with open(args.dry_run_json, "w") as f:
            json.dump({"world": args.dry_run, "ranks": rows, "disagreements": problems}, f, indent=1)
    return 1 if problems else 0
