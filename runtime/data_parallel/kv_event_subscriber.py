"""A subscriber to one replica's KV events that hands them over in order, without gaps,
asking the replica's replay socket for batches the PUB socket dropped or sent before it
connected."""

import logging

import msgspec
import zmq

from strata.engine_core.ipc import make_socket
from strata.engine_core.kv_events import KVEventBatch, encode_seq

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_MS = 2000


class KVEventSubscriber:
    """``poll()`` returns, without blocking (except for a replay), every batch that arrived
    since the last call, in sequence order. ``lost`` counts batches that neither the stream
    nor the replay buffer could supply (the replica published faster than anyone asked)."""

    def __init__(self, context: zmq.Context, endpoint: str, replay_endpoint: str) -> None:
        self._context = context
        self._sub = make_socket(context, zmq.SUB, endpoint, bind=False)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._replay_endpoint = replay_endpoint
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq = 0
        self.lost = 0

    def poll(self) -> list[KVEventBatch]:
        batches: list[KVEventBatch] = []
        while self._sub.poll(0):
            batch = self._decoder.decode(self._sub.recv())
            if batch.seq > self.next_seq:
                batches += self.replay()
            if batch.seq >= self.next_seq:
                batches.append(self._accept(batch))
        return batches

    def _accept(self, batch: KVEventBatch) -> KVEventBatch:
        if batch.seq > self.next_seq:
            logger.warning("KV-event batches %d..%d are lost", self.next_seq, batch.seq - 1)
            self.lost += batch.seq - self.next_seq
        self.next_seq = batch.seq + 1
        return batch

    def replay(self) -> list[KVEventBatch]:
        """Ask the replay socket for every batch from ``next_seq`` on; [] if it does not answer."""
        request = make_socket(self._context, zmq.REQ, self._replay_endpoint, bind=False)
        try:
            request.send(encode_seq(self.next_seq))
            if not request.poll(REPLAY_TIMEOUT_MS):
                logger.warning("no answer from the KV-event replay socket %s", self._replay_endpoint)
                return []
            frames = request.recv_multipart()[:-1]  # the empty frame ends the list
        finally:
            request.close(linger=0)
        batches = [self._decoder.decode(frame) for frame in frames]
        return [self._accept(batch) for batch in batches if batch.seq >= self.next_seq]

    def close(self) -> None:
        self._sub.close(linger=0)
