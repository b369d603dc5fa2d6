"""CurveZMQ on the executor's TCP sockets: only a peer with the workers' keys is ever sent a
frame; a plain peer and a peer with keys of its own get nothing."""

import time

import zmq

from strata.engine_core.ipc import make_socket
from strata.engine_core.zmq_curve import CurveServer, WorkerCurveKeys, secure_client

NUM_FRAMES = 20


def receive_all(sock: zmq.Socket, timeout_s: float = 0.5) -> list[bytes]:
    frames = []
    while sock.poll(int(timeout_s * 1000)):
        frames.append(sock.recv())
    return frames


def test_only_the_workers_key_receives_steps_from_a_curve_push_socket():
    context = zmq.Context()
    curve = CurveServer(context)
    try:
        steps = make_socket(context, zmq.PUSH, "tcp://127.0.0.1:*", bind=True, setup=curve.secure)
        endpoint = steps.getsockopt_string(zmq.LAST_ENDPOINT)
        plain = make_socket(context, zmq.PULL, endpoint, bind=False)
        own_public, own_secret = zmq.curve_keypair()
        stranger_keys = WorkerCurveKeys(curve.worker_keys.server_public, own_public, own_secret)
        stranger = make_socket(context, zmq.PULL, endpoint, bind=False, setup=secure_client(stranger_keys))
        worker = make_socket(context, zmq.PULL, endpoint, bind=False, setup=secure_client(curve.worker_keys))
        time.sleep(0.5)  # every handshake done (or refused) before the first frame
        for index in range(NUM_FRAMES):
            steps.send(str(index).encode())
        assert receive_all(worker) == [str(index).encode() for index in range(NUM_FRAMES)]
        assert receive_all(plain, 0.1) == [] and receive_all(stranger, 0.1) == []
    finally:
        curve.stop()
        context.destroy(linger=0)
