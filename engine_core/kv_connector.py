"""The scheduler's side of a KV connector: the hooks the scheduler calls, as a no-op base.

A connector moves KV blocks between the model's cache and somewhere else (the CPU tier of
``connector.offloading``). The scheduler asks it how many more prompt tokens it can supply
beyond the local prefix hit, tells it which blocks were allocated, collects the per-step
transfer metadata for the workers, and hears back which transfers finished.
"""

from engine_core.protocol import KVConnectorMetadata, KVConnectorOutput, SchedulerOutput
from engine_core.request import Request


class SchedulerConnector:
    """No-op connector: never has tokens, never delays a free. Subclasses override hooks."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the connector can load, and whether the load
        is asynchronous. ``None`` means "not known yet, ask again next step"."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request's block table after allocation; the last ``num_external_tokens``
        computed tokens are the connector's to load into it."""

    def request_preempted(self, request: Request, block_ids: list[int]) -> None:
        """The request is about to lose its blocks to preemption."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Transfers every worker rank has finished."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """True if the blocks must outlive the request until the connector reports the
        request in ``finished_sending`` (a store still reads them)."""
        return False

    def take_events(self) -> list[object]:
        return []
