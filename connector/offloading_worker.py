"""Worker side of the CPU offloading connector: a CPU block pool per rank and the copies.

Each step's transfers (see ``connector.offloading_scheduler`` for the id conventions) are
submitted as at most one load job and one store job: one copy call per layer per direction (a
gather/scatter), never a Python loop over blocks. On the CPU a background thread runs the jobs
in order with the C block copy. On CUDA the pool is pinned memory, which the GPU addresses
directly, and the Triton block-copy kernel moves the blocks on a side stream, after the work
already queued on the compute stream (the step that filled the blocks); each job ends in an
event that ``get_finished`` polls, so no thread waits on the copies and no pageable temporary
is made. A transfer is reported finished only once its job has completed.
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from strata.engine_core.protocol import BlockTransfer, KVConnectorMetadata, KVConnectorOutput
from strata.kernels import cpu_kv_cache, native, reference

BlockCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def block_copy_for(device: torch.device) -> BlockCopy:
    """The block copy between a cache on ``device`` and the CPU pool: the Triton kernel on CUDA
    (the GPU reads and writes the pinned pool directly), the C copy on the CPU where it builds
    (torch's copies would start a second OpenMP team from the copier thread, and libgomp then
    stops spinning for every team: the model's ops ran twice as slow), else torch."""
    if device.type == "cuda":
        from strata.kernels import triton_kv_cache  # Triton only where it compiles

        return triton_kv_cache.copy_blocks
    if native.load_library() is not None:
        return cpu_kv_cache.copy_blocks
    return reference.copy_blocks


class _StreamJob:
    """A job queued on the side stream: done once its ``finished`` event has been reached."""

    def __init__(self, num_blocks: int, started: torch.cuda.Event, finished: torch.cuda.Event) -> None:
        self.num_blocks = num_blocks
        self.started = started
        self.finished = finished

    def done(self) -> bool:
        return self.finished.query()

    def result(self) -> None:
        self.finished.synchronize()

    def seconds(self) -> float:
        return self.started.elapsed_time(self.finished) / 1000


class OffloadingConnectorWorker:
    def __init__(self, kv_caches: list[torch.Tensor], num_cpu_blocks: int) -> None:
        """``num_cpu_blocks`` is in GPU-block units (offload blocks x factor)."""
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        shape = (2, num_cpu_blocks, *kv_caches[0].shape[2:])
        pin = self.device.type == "cuda"
        self.cpu_pool = [torch.zeros(shape, dtype=c.dtype, pin_memory=pin) for c in kv_caches]
        self.block_bytes = sum(c[:, 0].numel() * c.element_size() for c in kv_caches)
        self._stream = torch.cuda.Stream(self.device) if pin else None
        self._copy_blocks = block_copy_for(self.device)
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload")
        self._jobs: list[tuple[Future | _StreamJob, list[str], list[str]]] = []
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
                if ready is None:
                    job: Future | _StreamJob = self._copier.submit(self._copy, transfers, is_load)
                else:
                    job = self._copy_on_stream(transfers, is_load, ready)
                ids = [t.transfer_id for t in transfers]
                self._jobs.append((job, [] if is_load else ids, ids if is_load else []))

    def get_finished(self) -> KVConnectorOutput | None:
        """Transfers completed since the last call (a copy that raised re-raises here)."""
        sending: list[str] = []
        receiving: list[str] = []
        pending = []
        for job, stores, loads in self._jobs:
            if job.done():
                job.result()
                if isinstance(job, _StreamJob):
                    self._count(job.num_blocks, job.seconds())
                sending += stores
                receiving += loads
            else:
                pending.append((job, stores, loads))
        self._jobs = pending
        with self._lock:
            moved, seconds = self._bytes_moved, self._transfer_seconds
            self._bytes_moved, self._transfer_seconds = 0, 0.0
        if not (sending or receiving or moved):
            return None
        return KVConnectorOutput(sending, receiving, moved, seconds)

    def _copy(self, transfers: list[BlockTransfer], is_load: bool) -> None:
        """A job on the copier thread (CPU caches)."""
        started = time.perf_counter()
        gpu_ids, cpu_ids = _block_ids(transfers, self.device)
        self._copy_layers(gpu_ids, cpu_ids, is_load)
        self._count(len(gpu_ids), time.perf_counter() - started)

    def _copy_on_stream(self, transfers: list[BlockTransfer], is_load: bool, ready: torch.cuda.Event) -> _StreamJob:
        """Queue a job on the side stream (CUDA caches), after ``ready`` on the compute stream."""
        started, finished = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            # Allocated on the side stream, so their memory is reused only after these copies.
            gpu_ids, cpu_ids = _block_ids(transfers, self.device)
            self._stream.wait_event(ready)
            started.record()
            self._copy_layers(gpu_ids, cpu_ids, is_load)
            finished.record()
        return _StreamJob(len(gpu_ids), started, finished)

    def _copy_layers(self, gpu_ids: torch.Tensor, cpu_ids: torch.Tensor, is_load: bool) -> None:
        for gpu_cache, cpu_cache in zip(self.kv_caches, self.cpu_pool):
            if is_load:
                self._copy_blocks(cpu_cache, gpu_cache, cpu_ids, gpu_ids)
            else:
                self._copy_blocks(gpu_cache, cpu_cache, gpu_ids, cpu_ids)

    def _count(self, num_blocks: int, seconds: float) -> None:
        with self._lock:
            self._bytes_moved += num_blocks * self.block_bytes
            self._transfer_seconds += seconds

    def wait_for_progress(self, timeout_s: float) -> None:
        """Block until a queued copy completes, or for ``timeout_s`` at most (returns at once
        when nothing is queued). On CUDA it waits for the oldest job, which is one step's copy."""
        if not self._jobs:
            return
        if self._stream is not None:
            self._jobs[0][0].result()
            return
        wait([job for job, _, _ in self._jobs], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def wait_idle(self) -> None:
        """Block until every queued copy has run (shutdown, tests)."""
        for job, _, _ in self._jobs:
            job.result()

    def shutdown(self) -> None:
        self._copier.shutdown(wait=True)
        if self._stream is not None:
            self._stream.synchronize()


def _block_ids(transfers: list[BlockTransfer], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The transfers' GPU and CPU block ids, on ``device`` (where the copy kernel reads them).
    On CUDA they go up from pinned memory without blocking: a copy from pageable memory would
    wait for the stream, i.e. for the step queued before the copies."""
    pin = device.type == "cuda"

    def on_device(ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, pin_memory=pin).to(device, non_blocking=True)

    return on_device([i for t in transfers for i in t.gpu_block_ids]), on_device([i for t in transfers for i in t.cpu_block_ids])
