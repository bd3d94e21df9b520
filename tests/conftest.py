"""Shared pytest setup: one thread per process (the suite runs many ranks on 2 cores) and pool teardown."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    from tests.dist import shutdown_pools

    shutdown_pools()


@pytest.fixture(scope="module", autouse=True)
def _schedule_registry_per_module():
    """Each test module leaves the schedule registry as it found it (`tests.registry_state`): no later module
    finds a plugin schedule it loaded (tools/plan.py ranks every registered schedule, and pool workers of
    other tests lack it), and the modules pass in any order."""
    from tests.registry_state import schedule_registry_restored

    with schedule_registry_restored():
        yield
