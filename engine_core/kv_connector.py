"""The scheduler's side of a KV connector: the hooks the scheduler calls, as a no-op base.

A connector moves KV blocks between the model's cache and somewhere else (the CPU tier of
``connector.offloading``). The scheduler asks it how many more prompt tokens it can supply
beyond the local prefix hit, tells it which blocks were allocated, collects the per-step
transfer metadata for the workers, and hears back which transfers finished.
"""

from strata.engine_core.kv_events import KVEvent
from strata.engine_core.protocol import KVConnectorMetadata, KVConnectorOutput, SchedulerOutput
from strata.engine_core.request import Request


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
        """Called when a waiting request gets its blocks (every admission). The last
        ``num_external_tokens`` of its computed tokens are the connector's to load."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> tuple[list[str], list[str]]:
        """Digest transfers every worker rank has finished. Returns the ids of requests whose
        load is complete and the hold keys (see ``request_finished``) that may be released."""
        return output.finished_recving, output.finished_sending

    def request_finished(self, request: Request, block_ids: list[int]) -> str | None:
        """The request is finished (or aborted). A returned hold key keeps its blocks
        allocated until ``update_connector_output`` releases that key: a copy still uses them."""
        return None

    def request_preempted(self, request: Request, block_ids: list[int]) -> str | None:
        """The request is about to lose its blocks to preemption; same contract as
        ``request_finished`` (a connector may flush the blocks to keep their KV)."""
        return None

    def take_events(self) -> list[KVEvent]:
        """KV events of the connector's own tier since the last call (drained every step)."""
        return []

    def scheduler_stats(self) -> dict[str, int | float]:
        """The connector's share of ``SchedulerStats`` (its ``offload_*`` fields)."""
        return {}
