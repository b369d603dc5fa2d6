"""Faults end cleanly: a killed or hung worker fails every in-flight request with an error
naming the rank, a dead EngineCore is noticed, and garbage frames are dropped."""

import contextlib
import os
import signal
import threading
import time

import msgspec
import psutil
import pytest
import zmq

from strata import LLM, SamplingParams
from strata.runtime import core_client
from strata.runtime.core_client import EngineCoreProcess, EngineDeadError, SyncCoreClient
from strata.runtime.engine_args import EngineArgs, resolve

# Long enough that no host finishes it before the faults below strike, 2-3 s in: 400 tokens once
# finished in under 2 s on a fast host, before the worker was suspended.
LONG = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)


def worker_pids(llm: LLM) -> list[int]:
    engine_core = psutil.Process(llm.engine.process.pid)
    return [p.pid for p in engine_core.children() if "strata.worker.worker_process" in " ".join(p.cmdline())]


def test_killed_worker_fails_requests_with_an_error_naming_the_rank():
    llm = LLM(executor="mp", tensor_parallel_size=2, dtype="float32", worker_timeout_s=30)
    try:
        victim = worker_pids(llm)[1]
        threading.Timer(3.0, os.kill, (victim, signal.SIGKILL)).start()
        started = time.monotonic()
        outputs = llm.generate(["Tell me a long story."] * 3, LONG, use_tqdm=False)
        assert time.monotonic() - started < 3.0 + 10
        for output in outputs:
            completion = output.outputs[0]
            assert completion.finish_reason == "error"
            assert "rank 1" in completion.error
        with pytest.raises(EngineDeadError):
            llm.generate("again", LONG, use_tqdm=False)
    finally:
        llm.shutdown()


def test_worker_killed_while_the_engine_is_idle_fails_the_next_request_instead_of_hanging():
    # The next step goes to a rank whose socket has lost its one peer: a plain send would wait
    # for a new one forever (a pipeline's next micro-batch once hung so after a node died).
    llm = LLM(executor="mp", dtype="float32", worker_timeout_s=30)
    try:
        victim = psutil.Process(worker_pids(llm)[0])
        victim.kill()
        with contextlib.suppress(psutil.NoSuchProcess):  # gone, or a zombie until the EngineCore reaps it
            while victim.status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.01)
        time.sleep(1)  # the EngineCore's ZeroMQ thread sees the peer gone within a millisecond or so
        outputs: list = []
        generating = threading.Thread(target=lambda: outputs.extend(llm.generate("Hi", LONG, use_tqdm=False)), daemon=True)
        generating.start()
        generating.join(10)
        assert not generating.is_alive(), "the engine is stuck sending its step to the dead rank"
        [output] = outputs
        assert output.outputs[0].finish_reason == "error"
        assert "worker rank 0 died (killed by signal 9)" in output.outputs[0].error
    finally:
        llm.shutdown()


def test_hung_worker_is_detected_by_the_timeout():
    llm = LLM(executor="mp", dtype="float32", worker_timeout_s=2)
    try:
        victim = psutil.Process(worker_pids(llm)[0])
        threading.Timer(2.0, victim.suspend).start()
        started = time.monotonic()
        (output,) = llm.generate("Tell me a long story.", LONG, use_tqdm=False)
        assert output.outputs[0].finish_reason == "error"
        assert "did not answer" in output.outputs[0].error and "rank" in output.outputs[0].error
        assert time.monotonic() - started < 2.0 + 10
    finally:
        llm.shutdown()


def test_dead_engine_core_is_noticed_instead_of_waiting_forever():
    llm = LLM(executor="mp", dtype="float32")
    try:
        threading.Timer(2.0, os.kill, (llm.engine.process.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="exited"):
            llm.generate("Tell me a long story.", LONG, use_tqdm=False)
        assert time.monotonic() - started < 2.0 + 10
    finally:
        llm.shutdown()


def test_garbage_frames_on_the_engine_input_do_not_stop_it():
    llm = LLM(executor="mp", dtype="float32")
    try:
        context = zmq.Context()
        intruder = context.socket(zmq.PUSH)
        intruder.connect(llm.engine.process.input_endpoint)
        for frame in [b"\x00garbage", msgspec.msgpack.encode(["add", 1, 2, 3]), msgspec.msgpack.encode({"x": 1}),
                      msgspec.msgpack.encode(["add", "r", [1], {"top_p": 5}, None, 0.0, 0])]:
            intruder.send(frame)
        intruder.close(linger=1000)
        context.term()
        (output,) = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert output.outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


class StopSignal(BaseException):
    """What a stop signal's handler raises wherever the frontend happens to be."""


def stop(*args, **kwargs):
    raise StopSignal


def test_a_stop_while_the_engine_core_process_is_handed_its_config_leaves_nothing_behind(monkeypatch):
    config = resolve(EngineArgs(dtype="float32"))
    monkeypatch.setattr(msgspec.msgpack, "encode", stop)  # once the process runs, before it has its config
    with pytest.raises(StopSignal):
        EngineCoreProcess(config)


def test_a_stop_while_the_client_connects_to_its_engine_core_stops_it(monkeypatch):
    config = resolve(EngineArgs(dtype="float32"))
    monkeypatch.setattr(core_client, "make_socket", stop)
    with pytest.raises(StopSignal):
        SyncCoreClient(config)
