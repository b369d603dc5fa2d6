"""Where the Ray executor places its ranks: torch- and Ray-free, so the engine flags can name it."""

from dataclasses import dataclass

RAY_PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayConfig:
    """Where the Ray executor runs its ranks. ``address=None``: ``$RAY_ADDRESS``, else a private
    local cluster. The placement group must be ready within ``placement_timeout_s``."""

    address: str | None = None
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 60.0
