"""Every multi-process test must leave no process and no IPC directory behind, even on failure."""

import glob
import os
import tempfile
import time

import psutil
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"


def _children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


@pytest.fixture(autouse=True)
def no_leftovers():
    before_pids = {p.pid for p in _children()}
    before_dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "strata-*")))
    yield
    deadline = time.monotonic() + 10
    leftover = []
    while time.monotonic() < deadline:
        leftover = [p for p in _children() if p.pid not in before_pids and p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE]
        if not leftover:
            break
        time.sleep(0.2)
    for process in leftover:
        process.kill()
    assert not leftover, f"processes left behind: {[p.cmdline() for p in leftover]}"
    dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "strata-*"))) - before_dirs
    assert not dirs, f"IPC directories left behind: {dirs}"


@pytest.fixture(scope="session")
def default_model_path():
    from strata.worker.model_loader import resolve_model_path

    return resolve_model_path(None)
