"""``python -m strata.launch.bench.router``: the cache-aware router's cost per KV event
(per block hash stored or removed), its memory per remembered hash, and the time to route a
2048-token prompt, for 2 and 100 replicas. In-process, no engine: the figures that say how
the router scales with the number of replicas."""

import os
import time
import tracemalloc

from strata.engine_core.kv_events import GPU_TIER, BlockRemoved, BlockStored
from strata.runtime.data_parallel.router import Router

NUM_HASHES = 200_000
HASHES_PER_EVENT = 32
PROMPT_TOKENS = 2048
ROUTINGS = 200


def measure(num_replicas: int, hashes: list[bytes]) -> dict[str, float]:
    stored = [BlockStored(hashes[i : i + HASHES_PER_EVENT], None, 512, GPU_TIER) for i in range(0, len(hashes), HASHES_PER_EVENT)]
    removed = [BlockRemoved(event.block_hashes, GPU_TIER) for event in stored]
    tracemalloc.start()
    sized = Router(num_replicas, "cache-aware", 16)
    for index, event in enumerate(stored):
        sized.apply(index % num_replicas, [event])
    memory, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del sized
    router = Router(num_replicas, "cache-aware", 16)
    started = time.perf_counter()
    for index, event in enumerate(stored):
        router.apply(index % num_replicas, [event])
    store_s = time.perf_counter() - started
    prompt = list(range(PROMPT_TOKENS))
    router.routed("request", 0, router.block_hashes(prompt), len(prompt))
    started = time.perf_counter()
    for _ in range(ROUTINGS):
        router.choose(router.block_hashes(prompt))
    choose_s = (time.perf_counter() - started) / ROUTINGS
    started = time.perf_counter()
    for index, event in enumerate(removed):
        router.apply(index % num_replicas, [event])
    remove_s = time.perf_counter() - started
    return {
        "replicas": num_replicas,
        "store_us_per_hash": store_s / len(hashes) * 1e6,
        "remove_us_per_hash": remove_s / len(hashes) * 1e6,
        "bytes_per_hash": memory / len(hashes),
        "route_us_per_request": choose_s * 1e6,
    }


def main() -> None:
    hashes = [os.urandom(16) for _ in range(NUM_HASHES)]
    for num_replicas in (2, 100):
        print(measure(num_replicas, hashes))


if __name__ == "__main__":
    main()
