"""No garbage collection inside an emulated step (megatron_pp/benchmarks/emulate.py, `_step_without_collector`): the
grids' forwards that outran their cost by 80-170 ms (docs/results/emulate_p*.json, "actions over cost") were as
long as a full collection of a rank's objects, struck by the allocation threshold. With the threshold at one
allocation, so that the collector would run all through a step if it could, every collection of the ranks
falls outside the steps' windows, and some do happen (between the steps)."""
import gc
import time

from megatron_pp.benchmarks.emulate import cost_model, family_schedule, worker_emulate
from tests.dist import run_distributed


def _worker(ctx, schedule, costs, steps):
    starts: list[float] = []

    def note(phase, info):
        if phase == "start":
            starts.append(time.perf_counter())

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    gc.callbacks.append(note)
    try:
        runs = worker_emulate(ctx, schedule, costs, steps)
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*threshold)
    return runs, starts


def test_no_collection_inside_a_step():
    schedule = family_schedule("1f1b", 2, 4)
    results = run_distributed(2, _worker, schedule, [cost_model("equal", 0.002)], 2)
    for runs, starts in results:
        windows = [(step["started"], max(c[2] for c in step["compute"])) for step in runs[0]]
        assert starts, "the collector never ran: the probe would show nothing"
        inside = [t for t in starts for begin, end in windows if begin <= t <= end]
        assert inside == [], f"{len(inside)} collections inside a step"
