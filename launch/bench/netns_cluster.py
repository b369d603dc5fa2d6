"""A multi-node Ray cluster on one Linux machine: each node in a network namespace of its own.

    python -m strata.launch.bench.netns_cluster [--nodes 3] [--cpus-per-node 1]   (as root)

N namespaces, each with one interface (``eth0``, its own address in a private /24), are joined
by veth pairs to a bridge that lives in one more namespace, so the machine's own namespace sees
none of it and nothing leaves the namespaces. Node 0 runs the Ray head (no CPUs by default, so
that ranks land on the other nodes), every other node ``ray start --address`` of the head, each
with its own ``--node-ip-address`` and temp dir, through the same ``ray start`` command line as
``strata launch ray``. A driver (``strata serve --executor ray``, an ``LLM``) joins from the
head's namespace: ``ip netns exec`` a command there, or ``entered`` it in this process.

``NamespaceCluster`` tears everything down on ``close`` (SIGKILL to every process in its
namespaces, then the namespaces, and with them the links and the bridge), also when a ``with``
block raises. The
faults a test needs: ``kill_node`` (every process of a node), ``set_link`` (its veth down or up)
and ``blackhole`` (everything the node sends silently lost).

Run as a script, it starts a cluster, prints how to reach it, and holds it until Ctrl-C.
"""

import argparse
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from strata.engine_core.ipc import die_with_parent
from strata.runtime.executors.ray_launcher import RayNodeOptions, start_command, start_environment

HEAD_PORT = 6379
SUBNET = "10.213.0"  # a /24; each cluster's bridge is in a namespace of its own, so clusters never meet
NODE_START_TIMEOUT_S = 120.0
PROCESS_EXIT_TIMEOUT_S = 10.0
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"  # where `ip netns add` mounts a namespace
# A node whose processes died is noticed in about a second and a half (its node manager refuses
# the checks), not Ray's default 15 s; one cut off (checks time out) still takes over 15 s, so
# that an engine's own step timeout, shorter, is what notices a dropped link.
HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "5000",
    "RAY_health_check_failure_threshold": "3",
}
RAY_START_ARGS = ["--object-store-memory", str(80 * 1024 * 1024)]  # Ray's minimum is about 75 MiB


class NamespaceError(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, no kernel support)."""


@dataclass(frozen=True)
class Node:
    """One Ray node: its namespace, its address there, and its veth's end in the bridge namespace."""

    index: int
    namespace: str
    address: str
    bridge_port: str
    cpus: int


def check_namespaces_available() -> None:
    """Raise NamespaceError saying why network namespaces cannot be created here."""
    if shutil.which("ip") is None:
        raise NamespaceError("no `ip` command (iproute2)")
    if os.geteuid() != 0:
        raise NamespaceError("creating network namespaces needs root")
    with _scratch_namespace():
        pass


@contextmanager
def _scratch_namespace() -> Iterator[str]:
    """A namespace to probe in, deleted afterwards; NamespaceError if it cannot be made."""
    name = f"strata-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        raise NamespaceError(f"`ip netns add` failed: {made.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NamespaceCluster:
    """``cpus[i]`` CPUs on node ``i`` (node 0 is the head). ``env`` is what a client of the
    cluster needs besides its address: the throw-away token of its token authentication, in
    ``RAY_AUTH_TOKEN`` unless the environment already had one."""

    def __init__(self, cpus: Sequence[int], subnet: str = SUBNET) -> None:
        if len(cpus) < 2:
            raise ValueError("a cluster of namespaces needs a head and at least one more node")
        tag = secrets.token_hex(3)
        self.bridge_namespace = f"strata-{tag}-br"
        self.nodes = [
            Node(i, f"strata-{tag}-n{i}", f"{subnet}.{i + 1}", f"p{i}", count) for i, count in enumerate(cpus)
        ]
        self.env = {"RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)}
        self._dir = Path(tempfile.mkdtemp(prefix=f"ns{tag}-"))  # short: Ray's socket paths live below
        self._ray_nodes: dict[int, subprocess.Popen] = {}
        self._starts = [0] * len(cpus)  # each node's `ray start`s so far: a restart appends to its log
        self._made: list[str] = []  # namespaces, in the order made
        self._links_down: set[int] = set()
        self._blackholed: set[int] = set()
        self._faulted: set[int] = set()  # nodes killed or cut off, whose Ray node restore() restarts

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        """The head's GCS address, for ``--ray-address``."""
        return f"{self.head.address}:{HEAD_PORT}"

    def __enter__(self) -> "NamespaceCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Make the network, then start the head and, once it answers, the other nodes together."""
        self._make_network()
        self.start_node(self.head)
        for node in self.nodes[1:]:
            self._ray_nodes[node.index] = self._spawn_ray_node(node)
        for node in self.nodes[1:]:
            self._wait_started(node)

    def _make_network(self) -> None:
        _ip("netns", "add", self.bridge_namespace)
        self._made.append(self.bridge_namespace)
        bridge = ("-n", self.bridge_namespace)
        _ip(*bridge, "link", "add", "br0", "type", "bridge")
        _ip(*bridge, "link", "set", "br0", "up")
        for node in self.nodes:
            _ip("netns", "add", node.namespace)
            self._made.append(node.namespace)
            veth = ("type", "veth", "peer", "name", "eth0", "netns", node.namespace)
            _ip(*bridge, "link", "add", node.bridge_port, *veth)
            _ip(*bridge, "link", "set", node.bridge_port, "master", "br0", "up")
            inside = ("-n", node.namespace)
            _ip(*inside, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "link", "set", "lo", "up")

    def start_node(self, node: Node) -> None:
        """Start ``node``'s Ray node (again, after ``kill_node``) and wait until it runs."""
        self._ray_nodes[node.index] = self._spawn_ray_node(node)
        self._wait_started(node)

    def _spawn_ray_node(self, node: Node) -> subprocess.Popen:
        options = RayNodeOptions(
            head=node.index == 0,
            address=None if node.index == 0 else self.address,
            port=HEAD_PORT if node.index == 0 else None,
            node_ip_address=node.address,
            num_cpus=node.cpus,
            temp_dir=str(self._dir / f"n{node.index}"),
            block=True,
            ray_start_args=RAY_START_ARGS,
        )
        environ = {**os.environ, **self.env, **HEALTH_CHECKS}
        environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # it would keep a node's address on loopback
        env = start_environment(options, environ)
        with open(self._log(node), "ab") as log:
            # Its own session: a Ctrl-C meant for the caller does not reach it (``close`` ends it).
            return subprocess.Popen(
                ["ip", "netns", "exec", node.namespace, *start_command(options)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=die_with_parent,
            )

    def _log(self, node: Node) -> Path:
        return self._dir / f"ray-start-n{node.index}.log"

    def _wait_started(self, node: Node) -> None:
        process, log = self._ray_nodes[node.index], self._log(node)
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if text.count("Ray runtime started") > self._starts[node.index]:
                self._starts[node.index] += 1
                return
            if process.poll() is not None:
                break
            time.sleep(0.2)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"Ray node {node.index} ({node.address}) did not start:\n{tail}")

    def pids(self, node: Node) -> list[int]:
        """Every process in ``node``'s namespace (this process excepted, should it be there)."""
        listed = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True, text=True)
        return [pid for pid in map(int, listed.stdout.split()) if pid != os.getpid()]

    def kill_node(self, node: Node) -> None:
        """End ``node`` as a machine would end: SIGKILL to its Ray node and every process on it."""
        self._faulted.add(node.index)
        for pid in self.pids(node):
            _kill(pid)
        process = self._ray_nodes.pop(node.index, None)
        if process is not None:
            process.wait()
        deadline = time.monotonic() + PROCESS_EXIT_TIMEOUT_S
        while self.pids(node) and time.monotonic() < deadline:
            time.sleep(0.1)  # SIGKILLed processes are still leaving

    def set_link(self, node: Node, up: bool) -> None:
        """Take ``node``'s link to the bridge down (its traffic is dropped) or bring it back."""
        _ip("-n", self.bridge_namespace, "link", "set", node.bridge_port, "up" if up else "down")
        if up:
            self._links_down.discard(node.index)
        else:
            self._links_down.add(node.index)
            self._faulted.add(node.index)

    def blackhole(self, node: Node, on: bool) -> None:
        """Lose every packet ``node`` sends, or stop losing them. The ``blackhole`` qdisc on its
        interface drops each packet while telling the sender it went out, as a network that
        loses everything would (netem's "loss 100%" does the same, but not every kernel has
        sch_netem; blackhole is built into every kernel with traffic control). Packets to the
        node still arrive: it hears its peers, but none of its answers reach them."""
        command = ["ip", "netns", "exec", node.namespace, "tc", "qdisc"]
        if on:
            subprocess.run([*command, "add", "dev", "eth0", "root", "blackhole"], check=True, capture_output=True)
            self._blackholed.add(node.index)
            self._faulted.add(node.index)
        else:
            subprocess.run([*command, "del", "dev", "eth0", "root"], check=True, capture_output=True)
            self._blackholed.discard(node.index)

    def restore(self) -> None:
        """Undo the faults: links up, no blackhole, and a fresh Ray node on every node that was
        killed or cut off (Ray may have declared it dead meanwhile, and then ends it). Faults
        are for the other nodes: the cluster does not outlive its head."""
        for index in list(self._links_down):
            self.set_link(self.nodes[index], up=True)
        for index in list(self._blackholed):
            self.blackhole(self.nodes[index], on=False)
        for index in sorted(self._faulted):
            self.kill_node(self.nodes[index])
            self.start_node(self.nodes[index])
        self._faulted.clear()

    @contextmanager
    def entered(self, node: Node) -> Iterator[None]:
        """The calling thread inside ``node``'s namespace: every socket it opens, every thread and
        process it starts meanwhile, is in there (sockets and processes stay there after)."""
        home_path = f"/proc/self/task/{threading.get_native_id()}/ns/net"
        with open(home_path) as home, open(f"{NETNS_DIR}/{node.namespace}") as there:
            _setns(there.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    def close(self) -> None:
        """End every Ray node as ``kill_node`` does (the cluster is thrown away: nothing to drain),
        then delete the namespaces (their links and the bridge go with them) and the temp dirs."""
        for node in self.nodes:
            if node.namespace in self._made:
                self.kill_node(node)
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
        self._made.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    def describe(self) -> str:
        """How to reach the cluster, for a person."""
        lines = [f"Ray cluster at {self.address}, nodes:"]
        lines += [f"  node {n.index}: {n.address} in namespace {n.namespace} ({n.cpus} CPU)" for n in self.nodes]
        token_file = self._dir / "auth_token"
        token_file.write_text(self.env["RAY_AUTH_TOKEN"])
        token_file.chmod(0o600)
        lines.append("serve from the head's namespace, e.g.:")
        lines.append(
            f"  ip netns exec {self.head.namespace} env RAY_AUTH_TOKEN_PATH={token_file} "
            f"strata serve --executor ray --ray-address {self.address} --tensor-parallel-size {len(self.nodes) - 1} "
            "--ray-placement-strategy STRICT_SPREAD --device cpu"
        )
        lines.append("  (then, from the same namespace: curl http://127.0.0.1:8000/health)")
        return "\n".join(lines)


def _setns(fd: int) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="Ray nodes, the head included (default 3)")
    parser.add_argument("--cpus-per-node", type=int, default=1, help="CPUs of each node but the head (default 1)")
    parser.add_argument("--head-cpus", type=int, default=0, help="CPUs of the head (default 0: no ranks there)")
    args = parser.parse_args(argv)
    check_namespaces_available()
    cpus = [args.head_cpus] + [args.cpus_per_node] * (args.nodes - 1)
    with NamespaceCluster(cpus) as cluster:
        print(cluster.describe(), flush=True)
        print("Ctrl-C stops the cluster and removes its namespaces.", flush=True)
        for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell's `&` job starts with it ignored
            signal.signal(signum, signal.default_int_handler)
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
