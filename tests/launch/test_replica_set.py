"""The data-parallel replicas' bookkeeping keeps stats for every replica from start, so that
``/metrics`` lists a replica the router has sent nothing yet, and drops a dead replica's; a
dead replica's requests fail as the engine's fault, naming the replica."""

from types import SimpleNamespace

from strata.engine_core.protocol import EngineCoreRequest, SchedulerStats
from strata.engine_core.sampling_params import SamplingParams
from strata.runtime.data_parallel.replicas import ReplicaSet


def two_replicas() -> ReplicaSet:
    args = SimpleNamespace(data_parallel_size=2, dp_routing="round-robin", dp_load_margin=2048, dp_router_max_hashes=64)
    return ReplicaSet(args, SimpleNamespace(scheduler=SimpleNamespace(block_size=16)), [None, None])


def test_every_replica_has_idle_stats_before_its_first_step_until_it_dies():
    replicas = two_replicas()
    try:
        assert replicas.stats == {0: SchedulerStats.before_any_step(), 1: SchedulerStats.before_any_step()}
        replicas.fail(1, "its EngineCore exited")
        assert list(replicas.stats) == [0]
    finally:
        replicas.close()


def test_a_dead_replicas_requests_fail_as_the_engines_fault_naming_it():
    replicas = two_replicas()
    try:
        routed = {replicas.route(EngineCoreRequest(name, [1, 2, 3], SamplingParams(), None, 0.0)): name for name in "ab"}
        [lost] = replicas.fail(1, "worker rank 0 on node 10.0.0.3 died").finished
        assert lost.request_id == routed[1] and lost.finish_reason == "error" and lost.engine_fault
        assert lost.message == "data-parallel replica 1 failed: worker rank 0 on node 10.0.0.3 died"
    finally:
        replicas.close()
