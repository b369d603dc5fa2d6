"""The worker side of the offloading connector: copies through the CPU pool (on the CPU, and
marked ``gpu`` from a CUDA cache through the pinned pool on the side stream), and waiting for
them."""

import time

import pytest
import torch

from strata.connector.offloading_worker import OffloadingConnectorWorker, block_copy_for
from strata.engine_core.protocol import BlockTransfer, KVConnectorMetadata
from strata.kernels import cpu_kv_cache, native, reference, triton_kv_cache


def make_worker(num_layers: int = 2, device: str = "cpu") -> OffloadingConnectorWorker:
    torch.manual_seed(0)
    caches = [torch.randn(2, 6, 16, 2, 16).to(device, torch.bfloat16) for _ in range(num_layers)]
    return OffloadingConnectorWorker(caches, num_cpu_blocks=4)


def test_cuda_caches_copy_with_the_triton_kernel_and_cpu_caches_with_the_c_copy():
    assert block_copy_for(torch.device("cuda")) is triton_kv_cache.copy_blocks
    cpu_copy = cpu_kv_cache.copy_blocks if native.load_library() is not None else reference.copy_blocks
    assert block_copy_for(torch.device("cpu")) is cpu_copy


def finish(worker: OffloadingConnectorWorker) -> tuple[list[str], list[str]]:
    worker.wait_idle()
    output = worker.get_finished()
    assert output is not None
    return output.finished_sending, output.finished_recving


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_stored_blocks_load_back_into_other_blocks(device):
    worker = make_worker(device=device)
    originals = [cache[:, [1, 4]].clone() for cache in worker.kv_caches]
    worker.start_transfers(KVConnectorMetadata(stores=[BlockTransfer("s", [1, 4], [3, 0])]))
    assert finish(worker) == (["s"], [])
    for cache in worker.kv_caches:
        cache.zero_()
    worker.start_transfers(KVConnectorMetadata(loads=[BlockTransfer("l", [5, 2], [3, 0])]))
    assert finish(worker) == ([], ["l"])
    for cache, original in zip(worker.kv_caches, originals):
        assert cache[:, [5, 2]].equal(original)
        assert cache[:, [0, 1, 3, 4]].eq(0).all()
    worker.shutdown()


def test_waiting_for_progress_returns_when_a_copy_finishes():
    worker = make_worker(num_layers=30)
    worker.start_transfers(KVConnectorMetadata(stores=[BlockTransfer("s", [0, 1, 2, 3], [0, 1, 2, 3])]))
    started = time.monotonic()
    worker.wait_for_progress(timeout_s=10.0)
    assert time.monotonic() - started < 5.0
    output = worker.get_finished()
    assert output is not None and output.finished_sending == ["s"]
    worker.shutdown()


def test_waiting_for_progress_with_nothing_queued_returns_at_once():
    worker = make_worker()
    started = time.monotonic()
    worker.wait_for_progress(timeout_s=10.0)
    assert time.monotonic() - started < 1.0
    worker.shutdown()
