"""The Ray executor: one worker actor per rank (pipeline stage x tensor-parallel rank), placed by
a placement group on a Ray cluster.

Ray does placement, start-up, health and teardown only. The per-step data path is the ZeroMQ
one of ``ZmqExecutor``, over TCP: the executor binds on the EngineCore's node, the actors
connect, and every frame is msgspec (Ray's pickling never touches a step). A rank whose actor
dies (killed, its node lost) is noticed through the long-running task that serves its steps.
"""

import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any

import msgspec
import psutil
import ray
from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
from ray._private.services import canonicalize_bootstrap_address
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from strata.engine_core.core_loop import ExecutorFailed
from strata.engine_core.ipc import free_tcp_port
from strata.runtime.executors.ray_config import RayConfig
from strata.runtime.executors.zmq_executor import RankExit, ZmqExecutor
from strata.worker.config import WorkerConfig, WorkerProcessConfig

logger = logging.getLogger(__name__)

NAMESPACE = "strata"
CONNECT_TIMEOUT_S = 5.0
PING_TIMEOUT_S = 2.0


# Two threads: one serves the steps, the other answers ``node_ip`` even while a step is stuck in
# a collective, which tells a rank waiting on a peer from a rank that nobody can reach.
@ray.remote(max_concurrency=2)
class RankWorker:
    """One tensor-parallel rank in a Ray actor: says where it runs, then serves steps exactly as a
    worker process does (``worker.worker_process.serve``) until told to shut down."""

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A free TCP port on this node's address: rank 0's is the torch.distributed rendezvous."""
        return free_tcp_port(self.node_ip())

    def serve(self, payload: bytes) -> None:
        """Run the steps; ``payload`` is a msgpack ``WorkerProcessConfig``."""
        from strata.worker.worker_process import serve

        config = msgspec.msgpack.decode(payload, type=WorkerProcessConfig)
        rank = config.worker.rank
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
        interface = _interface_with(self.node_ip())
        if interface is not None:
            # gloo otherwise talks over the interface of the host name, which peers may not reach.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        serve(config)


class RayExecutor(ZmqExecutor):
    """Ranks as Ray actors, one per bundle of a placement group (``{"GPU": 1, "CPU": 1}`` each
    on GPUs, ``{"CPU": 1}`` on CPUs). Start-up failures and dead actors raise ``ExecutorFailed``."""

    def __init__(
        self,
        config: WorkerConfig,
        ray_config: RayConfig,
        worker_timeout_s: float = 60.0,
        startup_timeout_s: float = 600.0,
    ) -> None:
        size = config.tensor_parallel_size * config.pipeline_parallel_size
        _join_cluster(ray_config.address, num_cpus=size)
        try:
            host = ray.util.get_node_ip_address()
            super().__init__(
                config.tensor_parallel_size, config.pipeline_parallel_size, worker_timeout_s, lambda name: f"tcp://{host}:*"
            )
        except BaseException:
            ray.shutdown()
            raise
        self.name = f"strata-{uuid.uuid4().hex[:8]}"
        self._placement_group: PlacementGroup | None = None
        self._actors: list[ActorHandle] = []
        self._runs: list[ray.ObjectRef] = []  # one serve task per rank: done means the rank is gone
        self._node_ips: list[str] = []  # each rank's node, once placed
        try:
            self._start(config, ray_config, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: WorkerConfig, ray_config: RayConfig, startup_timeout_s: float) -> None:
        use_gpu = config.device.startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self._placement_group = _reserve(
            self.name, bundle, self.size, ray_config.placement_strategy, ray_config.placement_timeout_s
        )
        self._actors = [
            RankWorker.options(
                name=f"{self.name}-rank{rank}",
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement_group, rank),
            ).remote()
            for rank in range(self.size)
        ]
        deadline = time.monotonic() + startup_timeout_s
        self._node_ips = [
            self._start_up(rank, actor.node_ip.remote(), deadline) for rank, actor in enumerate(self._actors)
        ]
        logger.info("%s: ranks placed on nodes %s", self.name, self._node_ips)
        init_method = f"tcp://{self._node_ips[0]}:{self._start_up(0, self._actors[0].free_port.remote(), deadline)}"
        # Ray sets each actor's CUDA_VISIBLE_DEVICES to the GPU it assigned, so that one is cuda:0.
        device = "cuda:0" if use_gpu else config.device
        for rank, actor in enumerate(self._actors):
            worker = msgspec.structs.replace(config, rank=rank, device=device, distributed_init_method=init_method)
            payload = msgspec.msgpack.encode(
                WorkerProcessConfig(worker, self.step_endpoints[rank], self.results_endpoint, self.worker_curve_keys)
            )
            self._runs.append(actor.serve.remote(payload))
        self._await_ready(max(0.0, deadline - time.monotonic()))

    def _start_up(self, rank: int, call: ray.ObjectRef, deadline: float) -> Any:
        """The result of a start-up call on rank ``rank``'s actor, or ExecutorFailed saying why not."""
        try:
            return ray.get(call, timeout=max(0.0, deadline - time.monotonic()))
        except RayActorError as error:
            raise ExecutorFailed(f"worker rank {rank} died ({_actor_death(error)}) during start-up") from error
        except GetTimeoutError as error:
            raise ExecutorFailed(f"worker rank {rank}'s Ray actor did not answer in time during start-up") from error

    def _rank_name(self, rank: int) -> str:
        if rank < len(self._node_ips):
            return f"worker rank {rank} on node {self._node_ips[rank]}"
        return super()._rank_name(rank)

    def _why_silent(self) -> str:
        """Which ranks' actors do not answer Ray either: those are cut off (their node
        unreachable, or too loaded to answer). Every rank is asked, not only the silent ones: a
        silent rank may wait on one that answered the step before it was cut off (a pipeline
        stage waiting for the hidden states of the stage before it, or a collective)."""
        pings = {rank: actor.node_ip.remote() for rank, actor in enumerate(self._actors)}
        answered, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=PING_TIMEOUT_S, fetch_local=False)
        cut_off = [self._rank_name(rank) for rank, ping in pings.items() if ping not in answered]
        if not cut_off:
            return ""
        return f"; {', '.join(cut_off)} did not answer Ray within {PING_TIMEOUT_S:g} s either: cut off from this node"

    def _exited_ranks(self) -> list[RankExit]:
        if not self._runs:
            return []
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0, fetch_local=False)
        return [self._how_it_ended(rank, run) for rank, run in enumerate(self._runs) if run in done]

    @staticmethod
    def _how_it_ended(rank: int, run: ray.ObjectRef) -> RankExit:
        try:
            ray.get(run)
        except RayActorError as error:
            return RankExit(rank, killed=True, cause=_actor_death(error))
        except RayTaskError as error:
            return RankExit(rank, killed=False, cause=f"its worker raised {type(error.cause).__name__}")
        return RankExit(rank, killed=False, cause="its worker returned")

    def _stop_workers(self, grace_s: float) -> None:
        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=grace_s, fetch_local=False)
        for actor in self._actors:
            ray.kill(actor)  # an actor outlives its finished task and would keep its bundle

    def shutdown(self) -> None:
        """Stop the workers and their actors, remove the placement group and leave the cluster
        (which stops it, if this executor started it)."""
        super().shutdown()
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
        ray.shutdown()


def _join_cluster(address: str | None, num_cpus: int) -> None:
    """Connect to the Ray cluster at ``address`` (else ``$RAY_ADDRESS``); with neither, start a
    private local one with ``num_cpus`` CPUs. Fails fast, with the likely cause, where Ray would
    wait (an address nobody answers on) or say only "failed to connect" (an auth mismatch)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if address is None:
            # "local": a new cluster, even where `ray start` left one Ray would otherwise pick up.
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE)
            return
        _check_reachable(address)
        # Ray itself only does this for a cluster it finds on its own ("auto"): with a token at
        # hand, authenticate, so that a cluster started with token authentication can be joined.
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        ray.init(address=address, namespace=NAMESPACE)
    except (ConnectionError, RayError) as error:
        what = "start a local Ray cluster" if address is None else f"join the Ray cluster at {address}"
        raise ExecutorFailed(
            f"could not {what} ({error}); with token authentication on, this node needs the cluster's "
            "token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        ) from error
    finally:
        if threading.current_thread() is threading.main_thread():
            # ray.init installs its own SIGTERM handler; the EngineCore's stops the workers first.
            signal.signal(signal.SIGTERM, sigterm)


def _check_reachable(address: str) -> None:
    """Raise ExecutorFailed unless the Ray head at ``address`` accepts TCP connections (Ray would
    retry for minutes). Checks the address Ray will dial: it rewrites a loopback host to this
    machine's external address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``."""
    try:
        dialled = canonicalize_bootstrap_address(address) or address
    except ValueError as error:
        raise ExecutorFailed(f"bad Ray address {address!r}: {error}") from error
    host, _, port = dialled.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as error:
        rewritten = f" (as Ray rewrites {address}: on loopback, set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)"
        raise ExecutorFailed(
            f"no Ray cluster answers at {dialled}{rewritten if dialled != address else ''}: {error}"
        ) from error


def _reserve(name: str, bundle: dict[str, float], size: int, strategy: str, timeout_s: float) -> PlacementGroup:
    """A ready placement group of ``size`` copies of ``bundle``; ExecutorFailed naming what is
    missing if the cluster cannot provide it within ``timeout_s``."""
    group = placement_group([dict(bundle) for _ in range(size)], strategy=strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if ready:
        return group
    remove_placement_group(group)
    asked = {resource: amount * size for resource, amount in bundle.items()}
    available, total = ray.available_resources(), ray.cluster_resources()
    missing = {r: need - available.get(r, 0) for r, need in asked.items() if need > available.get(r, 0)}
    shortfall = (
        f"missing {_resources(missing)}"
        if missing
        else f"enough in total, but not on the nodes {strategy} needs (PACK and SPREAD are more lenient)"
    )
    raise ExecutorFailed(
        f"the Ray cluster could not place {size} worker(s) of {bundle} ({strategy}) within {timeout_s:g} s: "
        f"asked {_resources(asked)}; available {_resources(available, asked)} "
        f"(of {_resources(total, asked)} in the cluster); {shortfall}"
    )


def _resources(amounts: dict[str, float], only: dict[str, float] | None = None) -> str:
    """``{"CPU": 3, "GPU": 1}`` as "3 CPU, 1 GPU" (restricted to the names in ``only``)."""
    names = amounts if only is None else only
    return ", ".join(f"{amounts.get(name, 0):g} {name}" for name in names)


def _actor_death(error: RayActorError) -> str:
    """Ray's reason for an actor's death, short: the first sentence of its message's last line
    (e.g. "The actor is dead because its node has died. Node Id: ...")."""
    sentence = str(error).strip().splitlines()[-1].strip().split(". ")[0].rstrip(".")
    return f"its Ray actor is dead: {sentence.removeprefix('The actor is dead because ')}"


def _interface_with(ip: str) -> str | None:
    """The name of the network interface that carries ``ip``, if any."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == ip for address in addresses):
            return name
    return None
