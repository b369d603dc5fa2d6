import msgspec
import pytest

from strata.engine_core.protocol import (
    AbortRequests,
    BlockTransfer,
    CachedRequestData,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishedRequest,
    FrontendMessage,
    KVConnectorMetadata,
    KVConnectorOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
    pack_handles,
    pack_tokens,
)
from strata.engine_core.sampling_params import SamplingParams

MESSAGES = [
    EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"]), 2, 12.5, 1),
    AbortRequests(["r1", "r2"]),
    EngineCoreOutputs(
        ["r1"], [42], {"r1": [TokenLogprobs([42, 7], [-0.1, -2.5])]},
        [FinishedRequest("r2", "error", "boom")], SchedulerStats(1, 2, 0.5, 10, 5, 0, 99),
    ),
    SchedulerOutput(
        step=3,
        new_requests=[NewRequestData("r1", 0, [1, 2], [], SamplingParams(), 2, [4, 5], 0, 2)],
        cached=CachedRequestData(pack_handles([1, 2]), {2: 16}, {1: [9]}),
        total_num_scheduled_tokens=19,
        finished_handles=[7],
        preempted_handles=[8],
        kv_connector_metadata=KVConnectorMetadata([BlockTransfer("t", [1], [2])], []),
    ),
    ModelRunnerOutput(3, 1, pack_tokens([5, 6]), {0: [TokenLogprobs([5], [-0.5])]}, KVConnectorOutput(["a"], ["b"])),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_message_round_trips_through_its_typed_decoder(message):
    kind = FrontendMessage if isinstance(message, (EngineCoreRequest, AbortRequests)) else type(message)
    decoded = msgspec.msgpack.Decoder(kind).decode(msgspec.msgpack.encode(message))
    assert decoded == message


@pytest.mark.parametrize("kind", [SchedulerOutput, ModelRunnerOutput, EngineCoreOutputs, FrontendMessage])
@pytest.mark.parametrize("frame", [b"", b"\xc1garbage", msgspec.msgpack.encode(["add", 1, 2]), msgspec.msgpack.encode({"a": 1})])
def test_corrupted_or_wrong_typed_frame_raises_a_decode_error(kind, frame):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        msgspec.msgpack.Decoder(kind).decode(frame)


def test_invalid_sampling_params_inside_a_request_frame_are_rejected():
    frame = msgspec.msgpack.encode(["add", "r", [1], {"top_p": 0}, None, 0.0, 0])
    with pytest.raises((msgspec.ValidationError, ValueError)):
        msgspec.msgpack.Decoder(FrontendMessage).decode(frame)


def test_steady_decode_costs_two_bytes_per_running_request():
    step = SchedulerOutput(step=100_000, cached=CachedRequestData(pack_handles(list(range(1000)))), total_num_scheduled_tokens=1000)
    assert len(msgspec.msgpack.encode(step)) < 2 * 1000 + 32
