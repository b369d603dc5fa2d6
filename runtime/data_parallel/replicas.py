"""Several EngineCore replicas behind one client: ``SyncDPClient`` for ``LLM``,
``AsyncDPClient`` for ``AsyncEngine`` and the server, both with the interface of the
single-engine client they wrap.

Each request goes to the replica the ``Router`` picks and stays there (its aborts follow
it). A replica that dies is taken out of routing and its in-flight requests finish with an
``error`` naming it; the others keep serving. The client itself is dead only once every
replica is.
"""

import asyncio
import logging
from collections.abc import Callable

import zmq

from strata.engine_core.protocol import EngineCoreOutputs, EngineCoreRequest, FinishedRequest, SchedulerStats
from strata.runtime.data_parallel.kv_event_subscriber import KVEventSubscriber
from strata.runtime.data_parallel.router import Router
from strata.runtime.core_client import POLL_MS, AsyncCoreClient, EngineDeadError, SyncCoreClient
from strata.runtime.engine_args import EngineArgs, ResolvedConfig

logger = logging.getLogger(__name__)


class ReplicaSet:
    """The bookkeeping both clients share: routing, which replica runs which request, the
    replicas' KV events and stats, and which replicas died (and why)."""

    def __init__(self, args: EngineArgs, config: ResolvedConfig, event_endpoints: list[tuple[str, str] | None]) -> None:
        self.router = Router(
            args.data_parallel_size, args.dp_routing, config.scheduler.block_size, args.dp_load_margin,
            args.dp_router_max_hashes,
        )
        self._context = zmq.Context()
        self.subscribers = [
            None if endpoints is None or args.dp_routing != "cache-aware" else KVEventSubscriber(self._context, *endpoints)
            for endpoints in event_endpoints
        ]
        self.owner: dict[str, int] = {}  # request id -> replica
        # Every replica from start, so that /metrics lists one the router has sent nothing yet.
        self.stats = {replica: SchedulerStats.before_any_step() for replica in range(args.data_parallel_size)}
        self.dead: dict[int, str] = {}

    @property
    def live(self) -> list[int]:
        return self.router.live

    def route(self, request: EngineCoreRequest) -> int:
        self.drain_events()
        block_hashes = self.router.block_hashes(request.prompt_token_ids, request.cache_salt, request.lora)
        replica = self.router.choose(block_hashes)
        self.router.routed(request.request_id, replica, block_hashes, len(request.prompt_token_ids))
        self.owner[request.request_id] = replica
        return replica

    def unroute(self, request_id: str) -> None:
        """Forget a request whose send failed (it is routed again)."""
        del self.owner[request_id]
        self.router.finished(request_id)

    def drain_events(self) -> None:
        for replica in self.live:
            subscriber = self.subscribers[replica]
            if subscriber is not None:
                for batch in subscriber.poll():
                    self.router.apply(replica, batch.events)

    def on_outputs(self, replica: int, outputs: EngineCoreOutputs) -> None:
        """Count ``replica``'s step in its load; name it in every error it reports."""
        if outputs.stats is not None:
            self.stats[replica] = outputs.stats
        for request_id in outputs.request_ids:
            self.router.generated(request_id)
        for finished in outputs.finished:
            if finished.message is not None and finished.finish_reason == "error":
                finished.message = f"data-parallel replica {replica}: {finished.message}"
            self.owner.pop(finished.request_id, None)
            self.router.finished(finished.request_id)

    def by_replica(self, request_ids: list[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            replica = self.owner.get(request_id)
            if replica is not None and replica not in self.dead:
                groups.setdefault(replica, []).append(request_id)
        return groups

    def fail(self, replica: int, reason: str) -> EngineCoreOutputs:
        """Take ``replica`` out; the outputs finish its in-flight requests with an error."""
        message = f"data-parallel replica {replica} failed: {reason}"
        logger.error("%s", message)
        self.dead[replica] = reason
        self.router.remove_replica(replica)
        self.stats.pop(replica, None)
        if self.subscribers[replica] is not None:
            self.subscribers[replica].close()
            self.subscribers[replica] = None
        lost = [request_id for request_id, owner in self.owner.items() if owner == replica]
        for request_id in lost:
            del self.owner[request_id]
        return EngineCoreOutputs(finished=[FinishedRequest(request_id, "error", message, engine_fault=True) for request_id in lost])

    def dead_reason(self) -> str | None:
        if self.live:
            return None
        return "; ".join(f"replica {replica}: {reason}" for replica, reason in sorted(self.dead.items()))

    def health(self) -> dict[int, str]:
        """Every replica's state: "ok", or why it died."""
        return {replica: self.dead.get(replica, "ok") for replica in range(len(self.subscribers))}

    def close(self) -> None:
        for subscriber in self.subscribers:
            if subscriber is not None:
                subscriber.close()
        self._context.destroy(linger=0)


class SyncDPClient:
    """N ``SyncCoreClient`` replicas, started together; ``get_output`` returns the next step
    outputs of whichever replica answers first. Construction starts the processes; call
    ``wait_ready`` before anything else."""

    def __init__(self, args: EngineArgs, config: ResolvedConfig) -> None:
        private_events = args.dp_routing == "cache-aware"
        self.clients: list[SyncCoreClient] = []
        try:
            for replica in range(args.data_parallel_size):
                self.clients.append(SyncCoreClient(config, replica, private_events, wait_ready=False))
        except BaseException:
            self._shutdown_clients()
            raise
        self.replicas = ReplicaSet(args, config, [client.process.kv_events_endpoints for client in self.clients])
        self._ready: list[EngineCoreOutputs] = []  # outputs to hand out before reading more
        self._poller = zmq.Poller()
        for client in self.clients:
            self._poller.register(client.output_socket, zmq.POLLIN)

    def wait_ready(self) -> None:
        """Wait for every replica; on a failure the caller shuts this client down."""
        for client in self.clients:
            client.wait_ready()

    @property
    def num_blocks(self) -> int:
        return self.clients[0].num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        while True:
            if not self.replicas.live:
                raise EngineDeadError(self.replicas.dead_reason() or "no replica is serving")
            replica = self.replicas.route(request)
            try:
                self.clients[replica].add_request(request)
                return
            except EngineDeadError as error:
                self.replicas.unroute(request.request_id)
                self._ready.append(self._fail(replica, str(error)))

    def abort_requests(self, request_ids: list[str]) -> None:
        for replica, ids in self.replicas.by_replica(request_ids).items():
            self.clients[replica].abort_requests(ids)

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas.live:
            self.clients[replica].reset_prefix_cache()

    def get_output(self) -> EngineCoreOutputs:
        """The next outputs of any replica (or the errors of a replica that died);
        EngineDeadError once every replica is gone."""
        while True:
            if self._ready:
                return self._ready.pop()
            if not self.replicas.live:
                raise EngineDeadError(self.replicas.dead_reason() or "no replica is serving")
            for replica in list(self.replicas.live):
                try:
                    self.clients[replica].check_alive()
                except EngineDeadError as error:
                    self._ready.append(self._fail(replica, str(error)))
            if self._ready:
                continue
            for socket, _ in self._poller.poll(POLL_MS):
                replica = next(i for i, client in enumerate(self.clients) if client.output_socket is socket)
                try:
                    outputs = self.clients[replica].next_output(timeout_s=0.0)
                except EngineDeadError as error:
                    self._ready.append(self._fail(replica, str(error)))
                    continue
                if outputs is not None:
                    fault = next((f.message for f in outputs.finished if f.engine_fault), None)
                    self.replicas.on_outputs(replica, outputs)
                    if fault is not None:
                        # The replica's engine failed its requests because it is stopping; its
                        # EngineDead follows, but a caller whose last request this finished would
                        # not read it: out of routing now.
                        self._ready.append(self._fail(replica, fault or "its engine stopped"))
                    return outputs

    def _fail(self, replica: int, reason: str) -> EngineCoreOutputs:
        self._poller.unregister(self.clients[replica].output_socket)
        return self.replicas.fail(replica, reason)

    def _shutdown_clients(self) -> None:
        for client in self.clients:
            client.shutdown()

    def shutdown(self) -> None:
        self._shutdown_clients()
        self.replicas.close()


class AsyncDPClient:
    """N ``AsyncCoreClient`` replicas with the interface of one."""

    def __init__(self, args: EngineArgs, config: ResolvedConfig) -> None:
        private_events = args.dp_routing == "cache-aware"
        self.clients = [
            AsyncCoreClient(config, replica, private_events) for replica in range(args.data_parallel_size)
        ]
        self.replicas = ReplicaSet(args, config, [client.process.kv_events_endpoints for client in self.clients])
        self._on_output: Callable[[EngineCoreOutputs], None] | None = None
        self._on_dead: Callable[[str], None] | None = None

    @property
    def num_blocks(self) -> int:
        return self.clients[0].num_blocks

    @property
    def dead_reason(self) -> str | None:
        return self.replicas.dead_reason()

    async def start(
        self, on_output: Callable[[EngineCoreOutputs], None], on_dead: Callable[[str], None]
    ) -> None:
        self._on_output, self._on_dead = on_output, on_dead
        try:
            await asyncio.gather(*(
                client.start(self._output_handler(replica), self._death_handler(replica))
                for replica, client in enumerate(self.clients)
            ))
        except BaseException:
            self.shutdown()
            raise

    def _output_handler(self, replica: int) -> Callable[[EngineCoreOutputs], None]:
        def handle(outputs: EngineCoreOutputs) -> None:
            self.replicas.on_outputs(replica, outputs)
            self._on_output(outputs)

        return handle

    def _death_handler(self, replica: int) -> Callable[[str], None]:
        def handle(reason: str) -> None:
            if replica in self.replicas.dead:  # a failed send noticed it before the reader did
                return
            self._on_output(self.replicas.fail(replica, reason))
            if not self.replicas.live:
                self._on_dead(self.replicas.dead_reason())

        return handle

    async def add_request(self, request: EngineCoreRequest) -> None:
        while True:
            if not self.replicas.live:
                raise EngineDeadError(self.replicas.dead_reason() or "no replica is serving")
            replica = self.replicas.route(request)
            try:
                await self.clients[replica].add_request(request)
                return
            except EngineDeadError as error:
                self.replicas.unroute(request.request_id)
                self._death_handler(replica)(str(error))

    async def abort_requests(self, request_ids: list[str]) -> None:
        for replica, ids in self.replicas.by_replica(request_ids).items():
            await self.clients[replica].abort_requests(ids)

    async def call_utility(self, method: str, timeout_s: float = 30.0) -> dict:
        """The call on every live replica: {replica: result} of those that answered. Raises
        the first failure if none did (a replica that failed is marked dead by its reader)."""
        live = list(self.replicas.live)
        if not live:
            raise EngineDeadError(self.replicas.dead_reason() or "no replica is serving")
        results = await asyncio.gather(
            *(self.clients[replica].call_utility(method, timeout_s) for replica in live), return_exceptions=True
        )
        answered = {replica: result for replica, result in zip(live, results) if not isinstance(result, BaseException)}
        if not answered:
            raise results[0]
        return answered

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()
        self.replicas.close()
