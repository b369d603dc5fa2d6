"""Worker side of the CPU offloading connector: a CPU block pool per rank and the copies.

Each step's transfers (see ``connector.offloading_scheduler`` for the id conventions) are
submitted as at most one load job and one store job, run in order by a background thread:
one copy call per layer per direction (a gather/scatter; on the CPU, the C block copy), never
a Python loop over blocks. On CUDA the thread
copies on its own stream, after the work already queued on the compute stream (the step
that filled the blocks), and the pool is pinned memory. A transfer is reported finished
only once its job has completed.
"""

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from strata.engine_core.protocol import BlockTransfer, KVConnectorMetadata, KVConnectorOutput
from strata.kernels import cpu_kv_cache, native, reference


class OffloadingConnectorWorker:
    def __init__(self, kv_caches: list[torch.Tensor], num_cpu_blocks: int) -> None:
        """``num_cpu_blocks`` is in GPU-block units (offload blocks x factor)."""
        self.kv_caches = kv_caches
        device = kv_caches[0].device
        shape = (2, num_cpu_blocks, *kv_caches[0].shape[2:])
        pin = device.type == "cuda"
        self.cpu_pool = [torch.zeros(shape, dtype=c.dtype, pin_memory=pin) for c in kv_caches]
        self.block_bytes = sum(c[:, 0].numel() * c.element_size() for c in kv_caches)
        self._stream = torch.cuda.Stream(device) if pin else None
        # On the CPU, torch's copies would start a second OpenMP team from the copier thread,
        # and libgomp then stops spinning for every team: the model's ops ran twice as slow.
        self._copy_blocks = (
            cpu_kv_cache.copy_blocks if device.type == "cpu" and native.load_library() is not None else reference.copy_blocks
        )
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload")
        self._jobs: list[tuple[Future, list[str], list[str]]] = []
        self._lock = threading.Lock()
        self._bytes_moved = 0
        self._transfer_seconds = 0.0

    def start_transfers(self, metadata: KVConnectorMetadata | None) -> None:
        """Queue this step's loads and stores; call before the step's forward."""
        if metadata is None or not (metadata.loads or metadata.stores):
            return
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # the copies must see every write the compute stream has queued
        for transfers, is_load in ((metadata.stores, False), (metadata.loads, True)):
            if transfers:
                future = self._copier.submit(self._copy, transfers, is_load, ready)
                ids = [t.transfer_id for t in transfers]
                self._jobs.append((future, [] if is_load else ids, ids if is_load else []))

    def get_finished(self) -> KVConnectorOutput | None:
        """Transfers completed since the last call (a copy that raised re-raises here)."""
        sending: list[str] = []
        receiving: list[str] = []
        pending = []
        for future, stores, loads in self._jobs:
            if future.done():
                future.result()
                sending += stores
                receiving += loads
            else:
                pending.append((future, stores, loads))
        self._jobs = pending
        with self._lock:
            moved, seconds = self._bytes_moved, self._transfer_seconds
            self._bytes_moved, self._transfer_seconds = 0, 0.0
        if not (sending or receiving or moved):
            return None
        return KVConnectorOutput(sending, receiving, moved, seconds)

    def _copy(self, transfers: list[BlockTransfer], is_load: bool, ready: torch.cuda.Event | None) -> None:
        started = time.perf_counter()
        gpu_ids = torch.tensor([i for t in transfers for i in t.gpu_block_ids], dtype=torch.long)
        cpu_ids = torch.tensor([i for t in transfers for i in t.cpu_block_ids], dtype=torch.long)
        if self._stream is None:
            self._copy_layers(gpu_ids, cpu_ids, is_load)
        else:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                self._copy_layers(gpu_ids, cpu_ids, is_load)
            self._stream.synchronize()
        with self._lock:
            self._bytes_moved += len(gpu_ids) * self.block_bytes
            self._transfer_seconds += time.perf_counter() - started

    def _copy_layers(self, gpu_ids: torch.Tensor, cpu_ids: torch.Tensor, is_load: bool) -> None:
        for gpu_cache, cpu_cache in zip(self.kv_caches, self.cpu_pool):
            if is_load:
                self._copy_blocks(cpu_cache, gpu_cache, cpu_ids, gpu_ids)
            else:
                self._copy_blocks(gpu_cache, cpu_cache, gpu_ids, cpu_ids)

    def wait_for_progress(self, timeout_s: float) -> None:
        """Block until a queued copy completes, or for ``timeout_s`` at most (returns at once
        when nothing is queued)."""
        futures = [future for future, _, _ in self._jobs]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def wait_idle(self) -> None:
        """Block until every queued copy has run (shutdown, tests)."""
        for future, _, _ in self._jobs:
            future.result()

    def shutdown(self) -> None:
        self._copier.shutdown(wait=True)
