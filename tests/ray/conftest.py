"""Ray tests keep every Ray process on loopback, authenticate with a throw-away token (nothing
is written to ~/.ray), and leave no process and no placement group behind."""

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

# Ray reads this when it is imported: without it, it swaps 127.0.0.1 for the external address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.pop("RAY_ADDRESS", None)
os.environ["HF_HUB_OFFLINE"] = "1"

GONE_TIMEOUT_S = 30.0


def live(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (a zombie has finished)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_until_none_left(find: Callable[[], list[psutil.Process]], timeout_s: float = GONE_TIMEOUT_S) -> None:
    """Fail, killing them, if the processes ``find`` returns do not all end within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = [command_line(p) for p in left]
    for process in left:
        process.kill()
    assert not names, f"processes left behind: {names}"


def descendants(root: psutil.Process | None = None) -> list[psutil.Process]:
    return live((root or psutil.Process()).children(recursive=True))


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def rank_workers() -> list[psutil.Process]:
    """This process's Ray actors serving ranks (Ray titles them ``ray::RankWorker...``)."""
    return [p for p in descendants() if "ray::RankWorker" in command_line(p)]


@pytest.fixture
def ray_temp_dir() -> Iterator[str]:
    """Ray's session directory for one test: short, as its socket paths must fit in 107 bytes."""
    path = tempfile.mkdtemp(prefix="ray-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A one-node cluster with 2 CPUs in this process, on loopback, shared by a module: its address."""
    import ray

    before = {p.pid for p in descendants()}
    temp_dir = tempfile.mkdtemp(prefix="ray-")  # short, like ray_temp_dir
    context = ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir)
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()
        wait_until_none_left(lambda: [p for p in descendants() if p.pid not in before])
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_rank_left_behind() -> Iterator[None]:
    """After each test: no rank actor runs, and no placement group is left in the shared cluster."""
    yield
    wait_until_none_left(rank_workers)
    import ray

    if ray.is_initialized():
        groups = ray.util.placement_group_table().values()
        assert [g["name"] for g in groups if g["state"] != "REMOVED"] == []
