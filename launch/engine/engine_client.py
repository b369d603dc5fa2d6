"""Starting an engine for a frontend: in this process (``--executor uni``) or as an EngineCore
process with workers (``mp``, ``ray``)."""

from typing import TYPE_CHECKING

from strata.engine_core.engine_core import EngineCore
from strata.engine_core.protocol import EngineCoreOutputs, EngineCoreRequest
from strata.launch.engine.core_client import SyncCoreClient
from strata.launch.engine_args import EngineArgs, ResolvedConfig, tokenizer_json_path

if TYPE_CHECKING:
    from strata.launch.data_parallel.replicas import SyncDPClient


class InprocClient:
    """The EngineCore in the caller's process: ``get_output`` runs one step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

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


def start_engine(args: EngineArgs, resolved: ResolvedConfig) -> "InprocClient | SyncCoreClient | SyncDPClient":
    if args.data_parallel_size > 1:
        from strata.launch.data_parallel.replicas import SyncDPClient

        return SyncDPClient(args, resolved)
    if args.executor == "uni":
        from strata.launch.executors.uni_executor import UniExecutor

        executor = UniExecutor(resolved.worker)
        connector = resolved.make_connector(executor.num_cpu_blocks)
        return InprocClient(EngineCore(resolved.scheduler, executor, connector, tokenizer_path=tokenizer_json_path(resolved.worker.model)))
    return SyncCoreClient(resolved)
