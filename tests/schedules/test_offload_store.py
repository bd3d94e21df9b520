"""OffloadStore state machine: never freed before the copy out completes, never read before the copy back
completes (copies delayed on purpose), views and shared storages moved once, pooled host buffers."""
from __future__ import annotations

import queue
import threading
import time
import weakref

import pytest
import torch

from megatron_pp.schedules.offload_store import HostBufferPool, OffloadStore, StashState


class _Ticket:
    def __init__(self, engine: "DeferredCopies", pairs) -> None:
        self.engine, self.pairs, self.completed = engine, list(pairs), False

    def run(self) -> None:
        if not self.completed:
            for dst, src in self.pairs:
                dst.copy_(src)
            self.completed = True

    def done(self) -> bool:
        return self.completed

    def wait(self) -> None:
        self.engine.waits += 1
        self.run()


class DeferredCopies:
    """A copy engine that runs nothing until told to (or until waited on, like a stream sync). The
    destination is poisoned with NaN bytes when the copy is issued, so an early read shows."""

    def __init__(self) -> None:
        self.issued: list[_Ticket] = []
        self.waits = 0

    def copy(self, pairs, to_host=True, after=None):
        for dst, _ in pairs:
            dst.fill_(0xFF)  # float32 0xFFFFFFFF is a NaN
        ticket = _Ticket(self, pairs)
        self.issued.append(ticket)
        return ticket

    def run_all(self) -> None:
        for ticket in self.issued:
            ticket.run()


class ThreadedCopies:
    """One worker thread that runs copies in issue order after a delay each: a slow copy stream."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.queue: queue.Queue = queue.Queue()
        self.waits = 0
        self.open = threading.Event()  # cleared: the stream stalls before its next copy
        self.open.set()
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while True:
            pairs, finished = self.queue.get()
            self.open.wait()
            time.sleep(self.delay_s)
            for dst, src in pairs:
                dst.copy_(src)
            finished.set()

    def copy(self, pairs, to_host=True, after=None):
        for dst, _ in pairs:
            dst.fill_(0xFF)
        finished = threading.Event()
        self.queue.put((list(pairs), finished))
        engine = self

        class Ticket:
            def done(self) -> bool:
                return finished.is_set()

            def wait(self) -> None:
                if not finished.is_set():
                    engine.waits += 1
                finished.wait()

        return Ticket()


class StreamCopies:
    """A copy engine that behaves like CUDA streams and the caching allocator: `frees_on_issue`, copies run
    only when told to (or waited on), a copy runs after the ticket it must follow, and each copy holds its
    source until it has run (what `record_stream` makes the allocator do)."""

    frees_on_issue = True

    def __init__(self) -> None:
        self.issued: list = []
        self.waits = 0

    def copy(self, pairs, to_host=True, after=None):
        pairs = list(pairs)
        for dst, _ in pairs:
            dst.fill_(0xFF)
        engine = self

        class Ticket:
            completed = False
            direction = "out" if to_host else "in"
            sources = [src for _, src in pairs]

            def run(self) -> None:
                if not self.completed:
                    if after is not None:
                        after.run()
                    for dst, src in pairs:
                        dst.copy_(src)
                    pairs.clear()  # the sources are released once copied
                    self.sources = []
                    self.completed = True

            def done(self) -> bool:
                return self.completed

            def wait(self) -> None:
                engine.waits += 1
                self.run()

        ticket = Ticket()
        self.issued.append(ticket)
        return ticket


def _model(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 64, generator=g, requires_grad=True)
    x = torch.randn(32, 64, generator=g, requires_grad=True)
    return w, x


def _forward(w, x):
    h = x @ w          # saves x (moves) and w (a parameter: excluded)
    y = torch.tanh(h)  # saves its output y (moves)
    return (y * y).sum()  # saves y again (same storage, once)


def _reference_grads():
    w, x = _model()
    _forward(w, x).backward()
    return w.grad, x.grad


def _stash_one(store: OffloadStore):
    """Stash 0 planned for offload: the forward y = tanh(x @ w) and its loss, w excluded as a parameter."""
    w, x = _model()
    store.exclude([w])
    store.plan([0])
    with store.stash(0):
        y = torch.tanh(x @ w)
        loss = (y * y).sum()
    return w, x, y, loss


def test_freed_only_after_the_copy_out_and_read_only_after_the_copy_back():
    engine = DeferredCopies()
    store = OffloadStore(copies=engine)
    w, x, y, loss = _stash_one(store)  # saves x (the caller's own: private) and y (autograd's alone)
    y_alive = weakref.ref(y)
    del y
    resident = store.live_bytes
    assert store.state(0) is StashState.SAVED and resident == 2 * 32 * 64 * 4

    store.offload(0, private=[x])
    assert store.state(0) is StashState.OFFLOADING
    store.poll()  # the copy has not run: nothing may be freed
    assert store.state(0) is StashState.OFFLOADING and x.untyped_storage().nbytes() == 32 * 64 * 4
    assert y_alive() is not None and store.live_bytes == resident and store.resident_count == 1
    engine.run_all()
    store.poll()
    assert store.state(0) is StashState.OFFLOADED
    assert x.untyped_storage().nbytes() == 0 and y_alive() is None  # emptied in place / dropped and freed
    assert store.live_bytes == 0 and store.resident_count == 0 and store.host_bytes == 16384
    assert w.untyped_storage().nbytes() == 64 * 64 * 4  # the parameter never moves

    store.reload(0)  # storages back on the device, filled with NaN until the copy runs
    assert store.state(0) is StashState.RELOADING and torch.isnan(x.detach()).all()
    assert store.live_bytes == resident and store.resident_count == 1
    loss.backward()  # autograd unpacks -> the store waits for the copy first
    assert engine.waits == 1 and store.state(0) is StashState.RELOADED
    ref_w, ref_x = _reference_grads()
    assert torch.equal(w.grad, ref_w) and torch.equal(x.grad, ref_x)
    store.release(0)
    assert store.live_bytes == 0 and store.host_bytes == 0 and not store.live


def test_an_engine_that_keeps_its_sources_lets_the_store_free_on_issue():
    """CUDA's path, on CPU: the device memory goes when the copy is queued, not when the CPU next sees it
    finished; the reload follows the copy out, and the gradients are exact."""
    engine = StreamCopies()
    store = OffloadStore(copies=engine)
    w, x, y, loss = _stash_one(store)
    y_storage = y.untyped_storage().data_ptr()
    del y
    store.offload(0)
    assert store.state(0) is StashState.OFFLOADED and store.live_bytes == 0 and store.resident_count == 0
    # Only the queued copy holds y's storage now.
    assert not engine.issued[0].done()
    assert y_storage in {t.untyped_storage().data_ptr() for t in engine.issued[0].sources}
    store.reload(0)  # issued while the copy out is still queued: it must run after it
    assert store.state(0) is StashState.RELOADING and engine.issued[1].direction == "in"
    loss.backward()
    assert engine.issued[0].done() and engine.issued[1].done() and not engine.issued[0].sources
    ref_w, ref_x = _reference_grads()
    assert torch.equal(w.grad, ref_w) and torch.equal(x.grad, ref_x)
    store.release(0)
    # The host buffer goes back with the reload as its fence: the next copy into it follows that copy.
    host = store.pool.take(store.copied_bytes)
    assert store.pool.fence(host) is engine.issued[1]


def test_backward_of_a_parked_stash_is_refused():
    store = OffloadStore()
    w, x = _model()
    store.exclude([w])
    store.plan([0])
    with store.stash(0):
        loss = _forward(w, x)
    store.offload(0)
    assert store.state(0) is StashState.OFFLOADED  # synchronous copies complete at once
    with pytest.raises(RuntimeError, match=r"stash 0 is read by its backward while parked in host memory"):
        loss.backward()
    with pytest.raises(RuntimeError, match="released while parked"):
        store.release(0)


def test_reload_while_the_copy_out_runs_keeps_the_device_data():
    engine = DeferredCopies()
    store = OffloadStore(copies=engine)
    w, x = _model()
    store.exclude([w])
    store.plan([0])
    with store.stash(0):
        loss = _forward(w, x)
    store.offload(0)
    store.reload(0)  # the data never left: no second copy
    assert store.state(0) is StashState.RELOADED and len(engine.issued) == 1
    loss.backward()
    assert torch.equal(x.grad, _reference_grads()[1])
    store.release(0)


def _views(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a = x * 2                    # saves nothing (a python scalar)
    b = a.t().sin()              # saves a view of a
    c = a[1:].cos()              # another view of a
    d = a.view(-1).exp()         # saves its own output
    return a, b, c, d


def test_views_and_repeated_saves_move_one_storage_once():
    x_ref = _model()[1]
    sum(t.sum() for t in _views(x_ref)[1:]).backward()
    store = OffloadStore()
    x = _model()[1]
    store.plan([0])
    with store.stash(0):
        a, b, c, d = _views(x)
        loss = b.sum() + c.sum() + d.sum()
    alive = [weakref.ref(a), weakref.ref(d)]
    del a, b, c, d
    store.offload(0)
    assert store.copied_bytes == 2 * 32 * 64 * 4  # a's storage once, d's once
    assert [ref() for ref in alive] == [None, None]  # both freed; the views come back from one copy
    store.reload(0)
    loss.backward()
    assert torch.equal(x.grad, x_ref.grad)
    store.release(0)


def _tiny_kept_shared(store: OffloadStore | None, table, index, shared, tiny):
    if store is None:
        loss0 = table[index].pow(2).sum() + (shared * shared).sum() + tiny.exp().sum()
        return loss0 + (shared @ shared).sum()
    with store.stash(0):
        e = table[index]                     # saves index (a batch tensor the caller keeps)
        loss0 = e.pow(2).sum() + (shared * shared).sum() + tiny.exp().sum()
    with store.stash(1):
        loss1 = (shared @ shared).sum()      # a second live stash saves `shared` too
    store.offload(0, keep=[index])
    assert index.untyped_storage().nbytes() == 2048 * 8 and int(index.sum()) == sum(range(2048))
    assert shared.untyped_storage().nbytes() == 64 * 64 * 4
    assert tiny.untyped_storage().nbytes() == 16 * 4  # 16 elements: not worth a copy
    assert table.untyped_storage().nbytes() == 4096 * 8 * 4  # a parameter
    assert store.copied_bytes == 2048 * 8 * 4  # only e moved
    store.reload(0)
    return loss0 + loss1


def test_tiny_kept_and_shared_storages_stay_on_the_device():
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(4096, 8, generator=g), None, torch.randn(64, 64, generator=g), torch.randn(16, generator=g)]
    leaves[1] = torch.arange(2048) % 4096
    grads = []
    for store in (None, OffloadStore()):
        table, index, shared, tiny = [t if t.dtype == torch.int64 else t.clone().requires_grad_() for t in leaves]
        if store is not None:
            store.exclude([table])
            store.plan([0, 1])
        _tiny_kept_shared(store, table, index, shared, tiny).backward()
        grads.append([table.grad, shared.grad, tiny.grad])
        if store is not None:
            store.release(0)
            store.release(1)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_host_buffers_come_from_power_of_two_bins_and_are_reused_across_steps():
    pool = HostBufferPool(pin_memory=False)
    assert [pool.take(n).numel() for n in (3000, 4096, 4097, 1)] == [4096, 4096, 8192, 2]
    store = OffloadStore()
    w, _ = _model()
    store.exclude([w])
    for step in range(3):
        x = _model(step)[1]
        store.plan([0, 1])
        losses = []
        for key in (0, 1):
            with store.stash(key):
                losses.append(_forward(w, x if key == 0 else x * 1))
            store.offload(key)
        for key in (0, 1):
            store.reload(key)
            losses[key].backward()
            store.release(key)
        if step == 0:
            first = (store.pool.allocations, store.pool.allocated_bytes)
    assert first == (2, 2 * 16384) and (store.pool.allocations, store.pool.allocated_bytes) == first
    assert store.peak_host_bytes == 2 * 16384 and store.host_bytes == 0


def test_slow_copies_in_a_background_thread_keep_gradients_exact():
    engine = ThreadedCopies(delay_s=0.02)
    store = OffloadStore(copies=engine)
    w, x = _model()
    store.exclude([w])
    store.plan([0, 1])
    engine.open.clear()  # the copy stream is busy: the first offload cannot finish yet
    with store.stash(0):
        loss = _forward(w, x)
    store.offload(0)
    store.poll()
    assert store.state(0) is StashState.OFFLOADING  # copy still pending: memory still held
    store.reload(0)
    assert store.state(0) is StashState.RELOADED  # cancelled in place
    engine.open.set()
    loss.backward()
    store.release(0)
    w.grad = x.grad = None
    with store.stash(1):
        loss = _forward(w, x)
    store.offload(1)
    deadline = time.monotonic() + 30
    while store.state(1) is not StashState.OFFLOADED and time.monotonic() < deadline:
        time.sleep(0.005)
        store.poll()
    assert store.state(1) is StashState.OFFLOADED
    engine.open.clear()
    store.reload(1)
    assert store.state(1) is StashState.RELOADING  # the copy back has not run yet
    threading.Timer(0.05, engine.open.set).start()
    loss.backward()  # unpack must block until the copy back has run
    assert engine.waits == 1
    ref_w, ref_x = _reference_grads()
    assert torch.equal(w.grad, ref_w) and torch.equal(x.grad, ref_x)
    store.release(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: side stream, events and pinned buffers")
def test_cuda_side_stream_copies_are_exact_and_pinned():
    device = torch.device("cuda")
    store = OffloadStore(device=device)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g).to(device).requires_grad_()
    x = torch.randn(512, 256, generator=g).to(device).requires_grad_()
    store.exclude([w])
    store.plan([0])
    with store.stash(0):
        loss = _forward(w, x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    store.offload(0, private=[x])  # x: the caller's own reference, emptied in place
    # Freed as soon as the copy is queued: no poll, no synchronisation.
    assert store.state(0) is StashState.OFFLOADED and x.untyped_storage().nbytes() == 0
    assert store.copies.out_stream != store.copies.in_stream
    torch.cuda.synchronize()
    torch.empty(1, device=device)  # the allocator retires the copy stream's use of the blocks
    assert torch.cuda.memory_allocated(device) <= before - store.copied_bytes
    assert store.pool.pin_memory and store.pool.take(1).is_pinned()
    store.reload(0)
    loss.backward()
    w_ref, x_ref = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    _forward(w_ref, x_ref).backward()
    assert torch.equal(w.grad, w_ref.grad) and torch.equal(x.grad, x_ref.grad)
    store.release(0)


def test_recomputed_spans_offload_their_saved_inputs():
    # Non-reentrant checkpointing saves a span's inputs through the ordinary saved-tensor hooks, so the
    # store moves exactly what recompute keeps; the rerun inside the backward is not recorded again.
    from torch.utils.checkpoint import checkpoint

    grads = []
    for store in (None, OffloadStore()):
        w, x = _model()
        if store is None:
            checkpoint(_forward, w, x * 1.5, use_reentrant=False).backward()
        else:
            store.exclude([w])
            store.plan([0])
            with store.stash(0):
                loss = checkpoint(_forward, w, x * 1.5, use_reentrant=False)
            assert store.live_bytes == 32 * 64 * 4  # only the span's input; its insides are recomputed
            store.offload(0)
            assert store.copied_bytes == 32 * 64 * 4 and store.live_bytes == 0
            store.reload(0)
            loss.backward()
            store.release(0)
        grads.append((w.grad, x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_a_store_that_offloads_nothing_reports_no_host_bytes():
    """A rank whose list holds no OFFLOAD reports 0 host bytes, not a stale or initial figure."""
    store = OffloadStore()
    w, x = _model()
    store.exclude([w])
    with store.stash(0):
        loss = _forward(w, x)
    loss.backward()
    store.release(0)
    assert (store.peak_host_bytes, store.host_bytes, store.copied_bytes) == (0, 0, 0)


def test_cuda_copies_run_after_their_sources_and_the_copy_they_follow(monkeypatch):
    """The CUDA path without a GPU: streams, events and tensors stood in for, every call logged. A copy waits
    on its side stream for an event recorded on the compute stream (its sources are written, its
    destinations allocated) and for the ticket it must follow; an offloaded source is marked as used by the
    copy stream, so the allocator does not hand its block out before the copy has run; the returned ticket
    is an event recorded after the copies, which the backward's stream waits on."""
    from megatron_pp.schedules import offload_store

    log, names = [], iter(["out", "in"])

    class Stream:
        def __init__(self, device=None, name=None):
            self.name = name or next(names)

        def wait_event(self, event):
            log.append(("wait", self.name, event.name))

    class Event:
        made = 0

        def __init__(self):
            self.name = f"event{Event.made}"
            Event.made += 1

        def record(self, stream):
            log.append(("record", self.name, stream.name))

        def query(self):
            log.append(("query", self.name))
            return True

    class Tensor:
        def __init__(self, name):
            self.name = name

        def copy_(self, src, non_blocking=False):
            log.append(("copy", self.name, src.name, non_blocking))

        def record_stream(self, stream):
            log.append(("record_stream", self.name, stream.name))

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(("enter", self.stream.name))

        def __exit__(self, *exc):
            log.append(("exit", self.stream.name))

    compute = Stream(name="compute")
    monkeypatch.setattr(offload_store.torch.cuda, "Stream", Stream)
    monkeypatch.setattr(offload_store.torch.cuda, "Event", Event)
    monkeypatch.setattr(offload_store.torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(offload_store.torch.cuda, "stream", StreamContext)
    copies = offload_store.CudaCopies(torch.device("cuda", 0))
    assert copies.frees_on_issue

    out = copies.copy([(Tensor("host0"), Tensor("dev0")), (Tensor("host1"), Tensor("dev1"))], to_host=True)
    assert log == [("record", "event0", "compute"), ("enter", "out"), ("wait", "out", "event0"),
                   ("copy", "host0", "dev0", True), ("record_stream", "dev0", "out"),
                   ("copy", "host1", "dev1", True), ("record_stream", "dev1", "out"),
                   ("record", "event1", "out"), ("exit", "out")]
    log.clear()
    back = copies.copy([(Tensor("dev2"), Tensor("host0"))], to_host=False, after=out)
    assert log == [("record", "event2", "compute"), ("enter", "in"), ("wait", "in", "event2"),
                   ("wait", "in", "event1"), ("copy", "dev2", "host0", True), ("record", "event3", "in"),
                   ("exit", "in")]
    log.clear()
    assert back.done() and log == [("query", "event3")]
    back.wait()
    assert log[1:] == [("wait", "compute", "event3")]


@pytest.mark.parametrize("min_numel, moved", [(32 * 64 - 1, 2), (32 * 64, 0)])
def test_a_storage_moves_only_when_larger_than_min_numel(min_numel, moved):
    # x and y are 32 x 64 = 2048 elements each: kept at min_numel 2048 (not larger), moved at 2047.
    store = OffloadStore(min_numel=min_numel)
    w, x, y, loss = _stash_one(store)
    store.offload(0, private=[x])
    store.poll()
    assert store.copied_bytes == moved * 32 * 64 * 4
    store.reload(0)
    loss.backward()
    ref_w, ref_x = _reference_grads()
    assert torch.equal(w.grad, ref_w) and torch.equal(x.grad, ref_x)
    store.release(0)


def test_releasing_a_reloading_stash_that_nothing_read_waits_for_its_copy_back():
    # Its host buffer goes back to the pool, so the copy back that reads it must have run first; a forward-only
    # use (or a backward that needs none of its tensors) never unpacks to wait.
    engine = DeferredCopies()
    store = OffloadStore(copies=engine)
    w, x, y, loss = _stash_one(store)
    store.offload(0, private=[x])
    engine.run_all()
    store.poll()
    store.reload(0)
    assert store.state(0) is StashState.RELOADING and engine.waits == 0
    store.release(0)
    assert engine.waits == 1 and engine.issued[-1].completed
    assert not torch.isnan(x.detach()).any()  # the copy back filled x's storage again
    assert store.host_bytes == 0 and store.live_bytes == 0


@pytest.mark.parametrize("numel, moved", [(1024, False), (1025, True)])
def test_by_default_storages_of_more_than_1024_elements_move(numel, moved):
    # The executor builds its store with the default threshold: smaller storages are not worth a copy.
    store = OffloadStore()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0), requires_grad=True)
    store.plan([0])
    with store.stash(0):
        loss = x.exp().sum()  # exp saves its output: one storage of `numel` elements
    store.offload(0)
    store.poll()
    assert store.copied_bytes == (numel * 4 if moved else 0)
    store.reload(0)
    loss.backward()
    assert torch.equal(x.grad, x.detach().exp())
    store.release(0)
