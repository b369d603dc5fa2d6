"""CurveZMQ for the TCP sockets between the EngineCore's executor and its workers.

Over TCP (``--executor ray``) anything that reaches a port could otherwise connect to a rank's
step socket and take a share of the steps. Each executor makes two key pairs: one for its own
(binding) sockets, one that its workers present. The workers get the executor's public key and
their key pair in their configuration (msgpack); a ZAP handler on the executor's context admits
only the workers' public key, so a peer without it never completes the handshake and is never
sent a frame. Local IPC sockets (private directory, mode 0700) stay plain.
"""

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "strata"


class CurveError(RuntimeError):
    """CurveZMQ is needed but this pyzmq/libzmq was built without it (no libsodium)."""


class WorkerCurveKeys(msgspec.Struct, array_like=True):
    """What a worker needs to talk to its executor: the executor's public key and the key
    pair the executor accepts from its workers (Z85-encoded, as zmq.curve_keypair makes them)."""

    server_public: bytes
    public: bytes
    secret: bytes


class CurveServer:
    """The executor's side: secures the sockets it binds and admits only its workers."""

    def __init__(self, context: zmq.Context) -> None:
        if not zmq.has("curve"):
            raise CurveError("this pyzmq has no CURVE support (libzmq built without libsodium)")
        self._public, self._secret = zmq.curve_keypair()
        worker_public, worker_secret = zmq.curve_keypair()
        self.worker_keys = WorkerCurveKeys(self._public, worker_public, worker_secret)
        self._authenticator = ThreadAuthenticator(context)
        self._authenticator.start()
        self._authenticator.configure_curve_callback(ZAP_DOMAIN, _OnlyKey(worker_public))

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server that asks the ZAP handler."""
        sock.curve_server = True
        sock.curve_secretkey = self._secret
        sock.zap_domain = ZAP_DOMAIN.encode()

    def stop(self) -> None:
        self._authenticator.stop()


def secure_client(keys: WorkerCurveKeys):
    """A socket set-up (before it connects) that presents the workers' key pair."""

    def setup(sock: zmq.Socket) -> None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret

    return setup


class _OnlyKey:
    """A ZAP credentials provider that admits one public key."""

    def __init__(self, public_key: bytes) -> None:
        self._public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._public_key
