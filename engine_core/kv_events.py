"""KV events: which block hashes enter and leave a replica's caches, published over ZeroMQ.

Every block registered in the GPU prefix cache or made ready in the CPU tier becomes a
``BlockStored``; every eviction a ``BlockRemoved``; ``reset_prefix_cache`` an
``AllBlocksCleared``. The EngineCore drains them every step into a ``KVEventBatch`` with a
sequence number. ``KVEventPublisher`` sends each batch on a PUB socket and keeps the last
``replay_size`` batches for a subscriber that missed some: it asks the replay socket (a
ROUTER; a REQ sends one frame, the first sequence number wanted, as 8 bytes big-endian) and
gets back one multipart message: every buffered batch from that number on, then an empty
frame that ends the list.
"""

import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from strata.engine_core.ipc import make_socket

logger = logging.getLogger(__name__)

GPU_TIER = "gpu"
CPU_TIER = "cpu"
DEFAULT_REPLAY_SIZE = 1024
_POLL_MS = 200


class BlockStored(msgspec.Struct, array_like=True, tag="stored"):
    """Blocks that became prefix-cache hits in ``tier``. ``block_hashes`` chain in order;
    ``parent_hash`` is the hash before the first (None at the root, or where the tier does
    not know it); ``token_count`` is the tokens they hold together; ``lora_id`` is the LoRA
    adapter load whose KV they hold (None: the base model; the id is in the hashes too)."""

    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_count: int
    tier: str
    lora_id: int | None = None


class BlockRemoved(msgspec.Struct, array_like=True, tag="removed"):
    block_hashes: list[bytes]
    tier: str


class AllBlocksCleared(msgspec.Struct, array_like=True, tag="cleared"):
    tier: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    """One step's events. ``seq`` counts batches from 0 without gaps."""

    seq: int
    timestamp: float
    events: list[KVEvent]


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a replay request is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


class KVEventPublisher:
    """Publishes batches on ``endpoint`` and answers replay requests on ``replay_endpoint``.

    ``publish`` (called by the EngineCore loop) only encodes and hands the frame to a
    background thread that owns both sockets, so the loop never waits on a subscriber. A
    PUB socket drops frames nobody reads, and the replay buffer is a bounded deque: memory
    stays bounded with or without subscribers."""

    def __init__(self, endpoint: str, replay_endpoint: str, replay_size: int = DEFAULT_REPLAY_SIZE) -> None:
        if replay_size < 1:
            raise ValueError(f"replay_size must be >= 1, got {replay_size}")
        self._context = zmq.Context()
        self._handoff_endpoint = f"inproc://kv-events-{id(self)}"
        self._handoff_in = make_socket(self._context, zmq.PULL, self._handoff_endpoint, bind=True)
        self._handoff_out = make_socket(self._context, zmq.PUSH, self._handoff_endpoint, bind=False)
        self._pub = make_socket(self._context, zmq.PUB, endpoint, bind=True)
        self._replay = make_socket(self._context, zmq.ROUTER, replay_endpoint, bind=True)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._next_seq = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Send ``events`` as the next batch (nothing for an empty list)."""
        if not events:
            return
        batch = KVEventBatch(self._next_seq, time.time(), events)
        self._next_seq += 1
        self._handoff_out.send_multipart([encode_seq(batch.seq), self._encoder.encode(batch)])

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._handoff_in, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        while not self._stopping.is_set():
            ready = dict(poller.poll(_POLL_MS))
            if self._handoff_in in ready:
                while self._handoff_in.poll(0):
                    seq, frame = self._handoff_in.recv_multipart()
                    self._buffer.append((decode_seq(seq), frame))
                    self._pub.send(frame)
            if self._replay in ready:
                self._answer_replay(self._replay.recv_multipart())

    def _answer_replay(self, frames: list[bytes]) -> None:
        identity, request = frames[0], frames[-1]
        try:
            start = decode_seq(request)
        except ValueError as error:
            logger.warning("ignored a malformed KV-event replay request: %s", error)
            start = self._next_seq  # answer with nothing, so the requester is not left hanging
        batches = [frame for seq, frame in self._buffer if seq >= start]
        self._replay.send_multipart([identity, b"", *batches, b""])

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2)
        for sock in (self._handoff_out, self._handoff_in, self._pub, self._replay):
            sock.close(linger=0)
        self._context.term()
