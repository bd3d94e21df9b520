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
