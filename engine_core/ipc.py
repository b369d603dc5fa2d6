"""ZeroMQ plumbing shared by every process: private IPC endpoints, sockets, and process hygiene."""

import ctypes
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class IpcDir:
    """A private directory for ``ipc://`` endpoints (mode 0700).

    The process that creates it removes it on ``cleanup``; children get its path, so the
    endpoints of a child that is SIGKILLed still disappear with their owner's clean-up."""

    def __init__(self, path: str | None = None) -> None:
        self.owned = path is None
        self.path = tempfile.mkdtemp(prefix="strata-") if path is None else path

    def endpoint(self, name: str) -> str:
        return f"ipc://{os.path.join(self.path, name)}"

    def cleanup(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)


def make_socket(
    context: zmq.Context, kind: int, endpoint: str, bind: bool, setup: Callable[[zmq.Socket], None] | None = None
) -> zmq.Socket:
    """A socket bound or connected to ``endpoint``; ``setup`` sets options first (CURVE keys)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if setup is not None:
        setup(sock)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no child is ever orphaned
    (covers a parent killed with SIGKILL, which runs no cleanup). No-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
