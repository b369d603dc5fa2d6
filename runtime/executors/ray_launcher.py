"""``strata launch ray``: start this machine's Ray node, the head or a node joining it, by running
Ray's own ``ray start`` with defaults fit for serving.

- No dashboard (``--dashboard`` brings it back) and no usage stats.
- Token authentication on: a cluster reachable by others runs their code otherwise. The head
  generates a token (``~/.ray/auth_token``) if it has none; other nodes and the serving process
  need the same token. ``--disable-auth`` (or an explicit ``RAY_AUTH_MODE``) decides otherwise.
- A loopback ``--node-ip-address`` makes a single-machine cluster that stays on loopback (Ray
  otherwise swaps 127.0.0.1 for the machine's external address).
- ``--block`` keeps the node in the foreground: SIGINT/SIGTERM stop it cleanly, and so does the
  death of this process. Without it, ``ray start`` leaves the node running in the background.
"""

import ipaddress
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from strata.engine_core.ipc import die_with_parent

DEFAULT_PORT = 6379  # Ray's


class LaunchError(RuntimeError):
    """The node cannot be started as asked; the message says what to do."""


@dataclass
class RayNodeOptions:
    """One node: the head (``head=True``) or one joining the head at ``address``.
    ``ray_start_args`` go to ``ray start`` unchanged (e.g. fixed ``--node-manager-port``)."""

    head: bool = False
    address: str | None = None
    port: int | None = None
    node_ip_address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    temp_dir: str | None = None
    dashboard: bool = False
    block: bool = False
    disable_auth: bool = False
    ray_start_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.head == (self.address is not None):
            raise ValueError("give either --head or --address HEAD:PORT")
        if self.port is not None and not self.head:
            raise ValueError("--port is the head's: a joining node gives --address HEAD:PORT")
        if self.dashboard and not self.head:
            raise ValueError("--dashboard is the head's: only the head runs one")


def ray_cli() -> str:
    """The ``ray`` command of this Python environment (nodes must all run the same one)."""
    return str(Path(sys.executable).with_name("ray"))


def start_command(options: RayNodeOptions) -> list[str]:
    command = [ray_cli(), "start", "--disable-usage-stats"]
    if options.head:
        # `ray start` refuses --include-dashboard on a joining node, whatever its value.
        dashboard = f"--include-dashboard={str(options.dashboard).lower()}"
        command += [dashboard, "--head", "--port", str(options.port or DEFAULT_PORT)]
    else:
        command += ["--address", options.address]
    for flag, value in [
        ("--node-ip-address", options.node_ip_address),
        ("--num-cpus", options.num_cpus),
        ("--num-gpus", options.num_gpus),
        ("--temp-dir", options.temp_dir),
    ]:
        if value is not None:
            command += [flag, str(value)]
    if options.block:
        command.append("--block")
    return command + options.ray_start_args


def start_environment(options: RayNodeOptions, environ: dict[str, str]) -> dict[str, str]:
    """``environ`` plus what the node needs; raises LaunchError when token authentication is on
    and a joining node has no token."""
    env = dict(environ, RAY_USAGE_STATS_ENABLED="0")
    if options.node_ip_address is not None and ipaddress.ip_address(options.node_ip_address).is_loopback:
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keeps Ray's node address the loopback one
    env["RAY_AUTH_MODE"] = "disabled" if options.disable_auth else env.get("RAY_AUTH_MODE", "token")
    if env["RAY_AUTH_MODE"] == "token" and not _has_token(env):
        if not options.head:
            raise LaunchError(
                "token authentication is on but this node has no token: copy the head's ~/.ray/auth_token "
                "here (or export RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH), or start every node with --disable-auth"
            )
        subprocess.run([ray_cli(), "get-auth-token", "--generate"], env=env, check=True, stdout=subprocess.DEVNULL)
    return env


def _has_token(env: dict[str, str]) -> bool:
    """Whether Ray finds a token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)."""
    found = subprocess.run([ray_cli(), "get-auth-token"], env=env, capture_output=True)
    return found.returncode == 0


def launch(options: RayNodeOptions) -> int:
    """Start the node; the exit status of ``ray start``. With ``block``, returns when it stops."""
    command, env = start_command(options), start_environment(options, dict(os.environ))
    print(f"strata: {shlex.join(command)}", flush=True)
    _print_next_steps(options, env)
    if not options.block:
        return subprocess.run(command, env=env).returncode
    # Its own session keeps a terminal's Ctrl-C from reaching it besides the forwarded signal;
    # die_with_parent stops it (and through Ray's fate sharing, the node) if this process is killed.
    node = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_parent)
    stop_requested = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True
        node.send_signal(signal.SIGTERM)  # Ray drains the node, then stops its processes

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = node.wait()
    return 0 if stop_requested else code  # `ray start` exits 1 even when stopped as asked


def _print_next_steps(options: RayNodeOptions, env: dict[str, str]) -> None:
    if options.head:
        head = f"{options.node_ip_address or 'HEAD_IP'}:{options.port or DEFAULT_PORT}"
        print(f"strata: other nodes join with:  strata launch ray --address {head}", flush=True)
        print(f"strata: serve on the head with: strata serve --executor ray --ray-address {head} ...", flush=True)
    if env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        print("strata: a loopback cluster: clients need RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 as well", flush=True)
    if env["RAY_AUTH_MODE"] == "token":
        print(
            "strata: token authentication is on: every node and every client needs the head's token "
            "(~/.ray/auth_token, or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH)",
            flush=True,
        )
    else:
        print("strata: WARNING: authentication is off: anyone who reaches the cluster's ports can run code on it")
