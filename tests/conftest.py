import os
import shutil
import tempfile

import pytest
import torch

# Without a GPU the Triton kernels can only run in Triton's interpreter (numpy on CPU tensors).
# ``@triton.jit`` reads TRITON_INTERPRET when it decorates a kernel, i.e. when a kernel module
# is imported, and pytest imports conftest.py before any test module, so this is early enough
# for every test. setdefault leaves an explicit choice by the caller alone.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs the suite in worker processes side by side (``-n`` in pyproject.toml). Each
# takes one core: torch in the worker, and every engine it starts, run one thread each
# (OMP_NUM_THREADS is inherited), as two workers' thread pools on two cores would spin against
# each other. Each worker gets a temporary directory of its own, so checks for IPC directories
# left behind in it see only that worker's.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER is not None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    os.environ["TMPDIR"] = tempfile.tempdir = tempfile.mkdtemp(prefix=f"{XDIST_WORKER}-")


def pytest_sessionfinish(session: pytest.Session) -> None:
    if XDIST_WORKER is not None:
        shutil.rmtree(tempfile.gettempdir(), ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where CUDA is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA, and torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
