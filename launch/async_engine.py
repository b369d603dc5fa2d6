"""The asyncio frontend over the EngineCore process: one async stream of deltas per request.

Used by the HTTP server. A background task receives each step's outputs, detokenizes them
and routes every completion's delta to its request's queue; leaving a stream early (a client
disconnect) aborts the request in the engine.
"""

import asyncio
import gc
import itertools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar


from strata.engine_core.protocol import EngineCoreOutputs, LoRAAdapter, SchedulerStats
from strata.engine_core.sampling_params import SamplingParams
from strata.runtime.data_parallel.replicas import AsyncDPClient
from strata.runtime.core_client import AsyncCoreClient, EngineDeadError
from strata.runtime.engine_args import EngineArgs, ResolvedConfig, resolve
from strata.launch.lora_registry import LoRARegistry
from strata.launch.output_processor import CompletionDelta, OutputProcessor
from strata.launch.outputs import RequestOutput
from strata.launch.prompts import encode_text
from strata.launch.tokenizer import load_tokenizer

T = TypeVar("T")


class AsyncEngine:
    """Create with ``await AsyncEngine.start(args)``; ``shutdown()`` stops the processes."""

    def __init__(self, args: EngineArgs, config: ResolvedConfig) -> None:
        if args.executor == "uni":
            raise ValueError("the async engine runs the EngineCore in its own process: use --executor mp or ray")
        self.args = args
        self.config = config
        if config.tokenizer_path is None:
            raise ValueError("the async engine and the server need a tokenizer: pass --tokenizer DIR, not --skip-tokenizer")
        self.loras = LoRARegistry.start(args, config)  # a bad --lora-modules stops here
        self.client = AsyncCoreClient(config) if args.data_parallel_size == 1 else AsyncDPClient(args, config)
        try:
            # Loaded here while the engine's processes start theirs (seconds of imports each).
            self.tokenizer = load_tokenizer(config.tokenizer_path)
        except BaseException:
            self.client.shutdown()
            raise
        self.processor = OutputProcessor.for_model(self.tokenizer, config.model_path)
        self._streams: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self.stats = SchedulerStats.before_any_step()  # as of the last step
        self.dead_reason: str | None = None
        self._background: set[asyncio.Task] = set()
        # One thread: HF tokenizers are not safe to call from several threads at once.
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    @classmethod
    async def start(cls, args: EngineArgs) -> "AsyncEngine":
        config = await asyncio.to_thread(resolve, args)
        engine = cls(args, config)
        await engine.client.start(engine._on_output, engine._on_dead)
        gc.freeze()  # the tokenizer and the engine's start-up objects: full collections skip them
        return engine

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def tokenize(self, prompt: str) -> list[int]:
        """A text prompt's token ids, with the tokenizer's default special tokens."""
        return encode_text(self.tokenizer, prompt)

    async def off_loop(self, work: Callable[..., T], *args: object) -> T:
        """Run ``work(*args)`` (tokenizing, chat templates: CPU work that grows with the prompt)
        on the tokenizer thread, so that the event loop keeps streaming other requests."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work, *args)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
        stream: bool = True,
    ) -> AsyncIterator[CompletionDelta]:
        """Stream the deltas of every completion of ``prompt`` until all are finished, with
        the LoRA adapter ``lora`` (one of ``self.loras``; None: the base model). ``stream``:
        False when the caller wants only whole completions, which come then as one delta each.
        Raises ``EngineDeadError`` if the engine dies meanwhile, ``ValueError`` at once for a
        request id already in use."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        request_id = request_id or f"request-{next(self._ids)}"
        text, token_ids = (prompt, self.tokenize(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        # Registered first: a duplicate request id raises here, before it could replace the
        # stream of the request that holds the id.
        requests = self.processor.add_request(request_id, text, token_ids, params, priority, cache_salt, lora, stream)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            for request in requests:
                await self.client.add_request(request)
            while not finished:
                item = await queue.get()
                if isinstance(item, EngineDeadError):
                    raise item
                yield item
                # The last step's deltas arrive together (one per completion that ended): the
                # stream ends once the request is finished and they have all been yielded.
                finished = self.processor.outputs[request_id].finished and queue.empty()
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer left early: stop spending compute on it
                children = self.processor.child_ids(request_id)
                self.processor.forget(request_id)
                if children and self.dead_reason is None:
                    self._spawn(self.client.abort_requests(children))
            self.processor.outputs.pop(request_id, None)

    def output_of(self, request_id: str) -> RequestOutput:
        """The cumulative output of a request still streaming (or just finished)."""
        return self.processor.outputs[request_id]

    async def debug_state(self) -> dict:
        """The EngineCore's state; with data parallelism, {replica: state} of the live ones."""
        return await self.client.call_utility("debug_state")

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (on every replica with data parallelism)."""
        await self.client.call_utility("reset_prefix_cache")

    def replica_stats(self) -> dict[int, SchedulerStats]:
        """Each serving replica's ``SchedulerStats`` as of its last step, idle ones' from start
        (replica 0 alone without data parallelism)."""
        if isinstance(self.client, AsyncDPClient):
            return dict(self.client.replicas.stats)
        return {0: self.stats}

    async def check_health(self) -> dict[int, str]:
        """Each replica's state, "ok" or why it died, once every live one answered a ping.
        Raises ``EngineDeadError`` if none serves."""
        if self.client.dead_reason is not None:
            raise EngineDeadError(self.client.dead_reason)
        await self.client.call_utility("ping", timeout_s=5.0)
        if isinstance(self.client, AsyncDPClient):
            return self.client.replicas.health()
        return {0: "ok"}

    def _on_output(self, outputs: EngineCoreOutputs) -> None:
        self.stats = outputs.stats or self.stats
        deltas, to_abort = self.processor.process(outputs)
        for delta in deltas:
            queue = self._streams.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
        if to_abort:
            self._spawn(self.client.abort_requests(to_abort))

    def _on_dead(self, reason: str) -> None:
        self.dead_reason = reason
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(reason))

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def shutdown(self) -> None:
        for task in self._background:  # aborts not sent yet would hit closed sockets
            task.cancel()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self.client.shutdown()
