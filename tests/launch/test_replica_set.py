"""The data-parallel replicas' bookkeeping keeps stats for every replica from start, so that
``/metrics`` lists a replica the router has sent nothing yet, and drops a dead replica's."""

from types import SimpleNamespace

from strata.engine_core.protocol import SchedulerStats
from strata.runtime.data_parallel.replicas import ReplicaSet


def test_every_replica_has_idle_stats_before_its_first_step_until_it_dies():
    args = SimpleNamespace(data_parallel_size=2, dp_routing="round-robin", dp_load_margin=2048, dp_router_max_hashes=64)
    replicas = ReplicaSet(args, SimpleNamespace(scheduler=SimpleNamespace(block_size=16)), [None, None])
    try:
        assert replicas.stats == {0: SchedulerStats.before_any_step(), 1: SchedulerStats.before_any_step()}
        replicas.fail(1, "its EngineCore exited")
        assert list(replicas.stats) == [0]
    finally:
        replicas.close()
