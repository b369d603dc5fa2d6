"""The EngineCore in the frontend's own process (``--executor uni``), behind the interface of
``SyncCoreClient``: ``get_output`` runs one step instead of waiting on a socket."""

from strata.engine_core.core import EngineCore
from strata.engine_core.protocol import EngineCoreOutputs, EngineCoreRequest
from strata.runtime.engine_args import ResolvedConfig, tokenizer_json_path


class InprocClient:
    """The EngineCore in the caller's process: ``get_output`` runs one step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    @classmethod
    def start(cls, resolved: ResolvedConfig) -> "InprocClient":
        """Loads the model into this process and builds the EngineCore around it."""
        from strata.runtime.executors.uni_executor import UniExecutor

        executor = UniExecutor(resolved.worker)
        connector = resolved.make_connector(executor.num_cpu_blocks)
        tokenizer_path = tokenizer_json_path(resolved.worker.model)
        return cls(EngineCore(resolved.scheduler, executor, connector, tokenizer_path=tokenizer_path))

    def wait_ready(self) -> None:
        """Nothing to wait for: the model is loaded once ``start`` returns."""

    @property
    def num_blocks(self) -> int:
        return self.core.scheduler.kv.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def get_output(self) -> EngineCoreOutputs:
        if not self.core.has_work():
            raise RuntimeError("get_output called with nothing in the engine")
        return self.core.step()

    def shutdown(self) -> None:
        self.core.shutdown()
