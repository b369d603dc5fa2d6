"""Where each replica publishes its KV events and serves their replay.

A user's ``--kv-events-endpoint`` is replica 0's; replica ``i`` publishes on the TCP port
``2 * i`` above it (the replay socket defaults to the port after its publisher's), or on the
IPC path with ``-i`` appended. Without a user endpoint, a replica whose events feed the
router publishes on private IPC paths in its own IPC directory.
"""

import re

from strata.engine_core.ipc import IpcDir

_TCP = re.compile(r"^tcp://(?P<host>.+):(?P<port>\d+)$")
PRIVATE_EVENTS = "kv-events"
PRIVATE_REPLAY = "kv-events-replay"


def default_replay_endpoint(endpoint: str) -> str:
    match = _TCP.match(endpoint)
    if match:
        return f"tcp://{match['host']}:{int(match['port']) + 1}"
    return f"{endpoint}-replay"


def replica_endpoint(endpoint: str, replica: int) -> str:
    match = _TCP.match(endpoint)
    if match:
        return f"tcp://{match['host']}:{int(match['port']) + 2 * replica}"
    if not endpoint.startswith("ipc://"):
        raise ValueError(f"a KV-event endpoint is tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    return endpoint if replica == 0 else f"{endpoint}-{replica}"


def connectable(endpoint: str) -> str:
    """The endpoint a local subscriber connects to for one bound on every interface."""
    match = _TCP.match(endpoint)
    if match and match["host"] in ("*", "0.0.0.0"):
        return f"tcp://127.0.0.1:{match['port']}"
    return endpoint


def replica_event_endpoints(
    endpoint: str | None, replay_endpoint: str | None, replica: int, ipc: IpcDir, private: bool
) -> tuple[str, str] | None:
    """(publish, replay) endpoints to bind for ``replica``, or None if it publishes nothing."""
    if endpoint is not None:
        replay = replay_endpoint or default_replay_endpoint(endpoint)
        return replica_endpoint(endpoint, replica), replica_endpoint(replay, replica)
    if private:
        return ipc.endpoint(PRIVATE_EVENTS), ipc.endpoint(PRIVATE_REPLAY)
    return None
