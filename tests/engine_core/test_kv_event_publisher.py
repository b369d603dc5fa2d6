"""The KV-event stream over ZeroMQ: a subscriber that missed batches (joined late, or
dropped them) gets them from the replay socket in order; the replay buffer is bounded."""

import time

import pytest
import zmq

from strata.engine_core.ipc import IpcDir
from strata.engine_core.kv_events import GPU_TIER, BlockRemoved, BlockStored, KVEventPublisher
from strata.runtime.data_parallel.kv_event_subscriber import KVEventSubscriber


@pytest.fixture
def endpoints():
    ipc = IpcDir()
    yield ipc.endpoint("events"), ipc.endpoint("replay")
    ipc.cleanup()


def stored(index: int) -> BlockStored:
    return BlockStored([index.to_bytes(16, "big")], None, 16, GPU_TIER)


def poll_until(subscriber: KVEventSubscriber, count: int, timeout_s: float = 10.0) -> list:
    batches, deadline = [], time.monotonic() + timeout_s
    while len(batches) < count and time.monotonic() < deadline:
        batches += subscriber.poll()
        time.sleep(0.01)
    return batches


def wait_until_sent(publisher: KVEventPublisher, seq: int) -> None:
    """The publisher's thread sends in the background; this waits until it sent `seq`."""
    deadline = time.monotonic() + 10
    while (not publisher._buffer or publisher._buffer[-1][0] != seq) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_late_subscriber_gets_the_batches_it_missed_from_the_replay_socket(endpoints):
    publisher = KVEventPublisher(*endpoints)
    context = zmq.Context()
    try:
        for index in range(5):  # nobody listens yet: the PUB socket drops these
            publisher.publish([stored(index)])
        publisher.publish([])  # an empty step is no batch
        subscriber = KVEventSubscriber(context, *endpoints)
        time.sleep(0.2)  # let the subscription reach the publisher
        publisher.publish([BlockRemoved([b"x" * 16], GPU_TIER)])
        batches = poll_until(subscriber, 6)
        assert [batch.seq for batch in batches] == list(range(6))
        assert [batch.events for batch in batches[:5]] == [[stored(index)] for index in range(5)]
        assert subscriber.lost == 0
        subscriber.close()
    finally:
        publisher.close()
        context.destroy(linger=0)


def test_batches_older_than_the_replay_buffer_are_counted_lost(endpoints):
    publisher = KVEventPublisher(*endpoints, replay_size=3)
    context = zmq.Context()
    try:
        for index in range(8):
            publisher.publish([stored(index)])
        wait_until_sent(publisher, 7)  # else a slow thread sends them live to the subscriber
        subscriber = KVEventSubscriber(context, *endpoints)
        time.sleep(0.2)
        publisher.publish([stored(8)])
        batches = poll_until(subscriber, 3)
        assert [batch.seq for batch in batches] == [6, 7, 8] and subscriber.lost == 6
        subscriber.close()
    finally:
        publisher.close()
        context.destroy(linger=0)


def test_the_replay_buffer_stays_bounded_with_nobody_listening(endpoints):
    publisher = KVEventPublisher(*endpoints, replay_size=16)
    try:
        for index in range(2000):
            publisher.publish([stored(index)])
        wait_until_sent(publisher, 1999)
        assert len(publisher._buffer) == 16 and publisher._buffer[0][0] == 1984
    finally:
        publisher.close()


def test_a_malformed_replay_request_gets_an_empty_answer(endpoints):
    publisher = KVEventPublisher(*endpoints)
    context = zmq.Context()
    request = context.socket(zmq.REQ)
    try:
        publisher.publish([stored(0)])
        request.connect(endpoints[1])
        request.send(b"bad")
        assert request.poll(5000) and request.recv_multipart() == [b""]
    finally:
        request.close(linger=0)
        publisher.close()
        context.destroy(linger=0)
