"""The real Scheduler with the offloading connector and a fake worker that holds the KV as
token ids: every forward checks that a request attends to exactly its own tokens, so a
wrong, early or lost copy fails where it happens."""

import random
import subprocess
import sys

import pytest

from strata.engine_core.kv_events import BlockRemoved, BlockStored
from strata.connector.offloading_scheduler import OffloadingConnectorScheduler
from connector_helpers import OffloadEngine, expected_output, make_engine, make_request
from strata.engine_core.block_hash import extend_block_hashes
from strata.engine_core.kv_connector import SchedulerConnector
from strata.engine_core.protocol import LoRAAdapter
from strata.engine_core.request import RequestStatus

PROMPT = list(range(10, 30))  # 20 tokens: five full GPU blocks of 4


def evict_from_gpu(engine: OffloadEngine) -> None:
    """Run an unrelated request that fills the whole GPU pool, evicting every cached block."""
    kv = engine.scheduler.kv
    num_tokens = kv.num_blocks * kv.block_size
    engine.add(make_request(f"filler-{len(engine.results)}", list(range(500, 500 + num_tokens)), 1))
    engine.run()


def test_resent_prompt_loads_its_prefix_from_cpu_after_the_gpu_evicted_it():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=32)
    engine.add(make_request("first", PROMPT))
    engine.run()
    assert [type(event) for event in engine.connector.take_events()] == [BlockStored]
    evict_from_gpu(engine)
    prefilled = engine.scheduler.prompt_tokens_computed

    resent = engine.add(make_request("resent", PROMPT))
    out, _ = engine.step()
    assert resent.status == RequestStatus.WAITING_FOR_KV and out.new_requests == []
    [load] = out.kv_connector_metadata.loads
    assert load.gpu_block_ids == engine.scheduler.kv.get_block_ids("resent")[:4]
    engine.run()

    # Four blocks loaded; only the last block's four tokens are prefilled (the last token
    # must be computed for its logits, so the fifth block is not loaded).
    assert engine.scheduler.prompt_tokens_computed - prefilled == 4
    assert engine.results["resent"].token_ids == engine.results["first"].token_ids == expected_output(PROMPT, 2)
    stats = engine.connector.stats
    assert (stats.queried_tokens, stats.hit_tokens, stats.blocks_loaded) == (20 + 48 + 20, 16, 4)
    engine.assert_idle()


def blocks_loaded_for(engine, request_id: str, **request_fields: object) -> int:
    """Run PROMPT as a request with ``request_fields`` set, then evict it from the GPU cache: the
    blocks the CPU tier loaded for it."""
    request = make_request(request_id, PROMPT)
    for name, value in request_fields.items():
        setattr(request, name, value)
    loaded = engine.connector.stats.blocks_loaded
    engine.add(request)
    engine.run()
    loaded = engine.connector.stats.blocks_loaded - loaded
    evict_from_gpu(engine)
    return loaded


def test_cpu_tier_serves_a_prefix_only_to_requests_with_the_same_cache_salt():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=64)
    assert blocks_loaded_for(engine, "first", cache_salt="tenant-a") == 0
    assert blocks_loaded_for(engine, "other-tenant", cache_salt="tenant-b") == 0
    assert blocks_loaded_for(engine, "unsalted", cache_salt=None) == 0
    assert blocks_loaded_for(engine, "same-tenant", cache_salt="tenant-a") == 4
    assert engine.results["same-tenant"].token_ids == expected_output(PROMPT, 2)
    engine.assert_idle()


def test_cpu_tier_serves_a_prefix_only_to_requests_with_the_same_adapter():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=64, max_loras=2)
    adapter_a, adapter_b = LoRAAdapter("a", 1, "/a"), LoRAAdapter("b", 2, "/b")
    assert blocks_loaded_for(engine, "first", lora=adapter_a) == 0
    assert blocks_loaded_for(engine, "other-adapter", lora=adapter_b) == 0
    assert blocks_loaded_for(engine, "base", lora=None) == 0
    assert blocks_loaded_for(engine, "same-adapter", lora=adapter_a) == 4
    engine.assert_idle()


def test_without_gpu_prefix_caching_the_cpu_tier_still_serves_prefixes():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=32, enable_prefix_caching=False)
    engine.add(make_request("first", PROMPT))
    engine.run()
    prefilled = engine.scheduler.prompt_tokens_computed
    engine.add(make_request("resent", PROMPT))
    engine.run()
    assert engine.scheduler.prompt_tokens_computed - prefilled == 4
    assert engine.results["resent"].token_ids == expected_output(PROMPT, 2)
    engine.assert_idle()


def test_an_offload_block_spans_factor_gpu_blocks_and_as_many_cpu_sub_blocks():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=8, factor=2)
    engine.add(make_request("first", PROMPT))
    out, _ = engine.step()
    assert out.kv_connector_metadata is None  # a block is stored in the step after it filled
    gpu_blocks = engine.scheduler.kv.get_block_ids("first")
    out, _ = engine.step()
    [store] = out.kv_connector_metadata.stores
    assert store.gpu_block_ids == gpu_blocks[:4]  # 20 tokens fill two offload blocks of 8
    first, second = store.cpu_block_ids[0] // 2, store.cpu_block_ids[2] // 2
    assert first != second
    assert store.cpu_block_ids == [2 * first, 2 * first + 1, 2 * second, 2 * second + 1]
    engine.run()

    evict_from_gpu(engine)
    engine.add(make_request("resent", PROMPT))
    out, _ = engine.step()
    [load] = out.kv_connector_metadata.loads
    assert load.cpu_block_ids == store.cpu_block_ids
    assert load.gpu_block_ids == engine.scheduler.kv.get_block_ids("resent")[:4]
    engine.run()
    assert engine.results["resent"].token_ids == expected_output(PROMPT, 2)
    engine.assert_idle()


def test_cpu_hits_continue_only_an_aligned_local_hit_and_never_claim_the_last_token():
    connector = OffloadingConnectorScheduler(block_size=4, offload_block_size=8, num_cpu_blocks=8)
    request = make_request("r", list(range(10, 26)))  # 16 tokens: two offload blocks
    extend_block_hashes(request.block_hashes, request.all_token_ids, 4)
    plan = connector.tier.prepare_store(request.block_hashes[1::2])
    connector.tier.complete_store(plan.hashes)
    assert connector.get_num_new_matched_tokens(request, 0) == (8, True)  # token 16 is computed
    assert connector.get_num_new_matched_tokens(request, 4) == (0, False)  # ends mid-block
    assert connector.get_num_new_matched_tokens(request, 8) == (0, False)
    request.append_output_token(7)
    assert connector.get_num_new_matched_tokens(request, 8) == (8, True)


def run_without_cpu_tier(requests: list[tuple[str, list[int], int]], num_gpu_blocks: int, **config) -> int:
    """Tokens the model computes for the same work with no connector."""
    engine = make_engine(num_gpu_blocks, 1, **config)
    engine.scheduler.connector = SchedulerConnector()
    for request_id, prompt, max_tokens in requests:
        engine.add(make_request(request_id, prompt, max_tokens))
    engine.run()
    return engine.tokens_computed


def test_preempted_request_reloads_its_flushed_blocks_instead_of_recomputing():
    work = [("early", list(range(10, 22)), 14), ("late", list(range(40, 52)), 14)]
    config = dict(num_gpu_blocks=10, enable_prefix_caching=False)
    engine = make_engine(num_cpu_blocks=32, copy_steps=1, **config)
    for request_id, prompt, max_tokens in work:
        engine.add(make_request(request_id, prompt, max_tokens))
    resumed = []
    for out, _ in engine.steps():
        if out.preempted_handles:
            assert engine.scheduler.kv.held, "a preempted request's blocks stay held while flushed"
        resumed += [new.num_computed_tokens for new in out.new_requests if new.request_id == "late"]
    assert engine.scheduler.num_preemptions > 0
    assert resumed[0] == 0 and resumed[1] > 0, "the resumed request starts from its flushed blocks"
    assert engine.tokens_computed < run_without_cpu_tier(work, **config)
    for request_id, prompt, max_tokens in work:
        assert engine.results[request_id].token_ids == expected_output(prompt, max_tokens)
    engine.assert_idle()


def test_a_slow_load_keeps_the_request_waiting_until_it_is_reported_done():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=32, enable_prefix_caching=False)
    engine.add(make_request("first", PROMPT))
    engine.run()
    engine.runner.copy_steps = 3
    resent = engine.add(make_request("resent", PROMPT))
    for _ in range(4):  # the step that starts the load and the three it takes
        out, _ = engine.step()
        assert resent.status == RequestStatus.WAITING_FOR_KV and out.new_requests == []
    out, _ = engine.step()
    assert [(new.request_id, new.num_computed_tokens) for new in out.new_requests] == [("resent", 16)]
    engine.run()
    assert engine.results["resent"].token_ids == expected_output(PROMPT, 2)
    engine.assert_idle()


def test_a_slow_store_is_no_hit_and_holds_its_gpu_blocks_until_it_lands():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=32, copy_steps=3)
    first = engine.add(make_request("first", PROMPT, max_tokens=1))
    engine.step()  # prefill and finish; its five full blocks are stored from the next step
    for _ in range(4):
        assert engine.scheduler.kv.held and engine.connector.tier.lookup(first.block_hashes) == 0
        engine.step()
    assert not engine.scheduler.kv.held and engine.connector.tier.lookup(first.block_hashes) == 5
    engine.assert_idle()


def test_a_block_being_stored_is_never_evicted_to_make_room():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=5, copy_steps=2)
    first = engine.add(make_request("first", PROMPT, max_tokens=1))
    other = engine.add(make_request("other", list(range(60, 80)), max_tokens=1))
    engine.step()
    # Both finished; the tier only had room for the first one's five blocks, all in flight,
    # so the other's blocks are not stored and go back to the pool at once.
    assert list(engine.scheduler.kv.held.values()) and len(engine.scheduler.kv.held) == 1
    engine.run()
    assert engine.connector.tier.lookup(first.block_hashes) == 5
    assert engine.connector.tier.lookup(other.block_hashes) == 0
    engine.assert_idle()


def test_abort_during_a_load_holds_its_blocks_until_the_load_lands():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=32, copy_steps=2)
    engine.add(make_request("first", PROMPT))
    engine.run()
    evict_from_gpu(engine)
    engine.add(make_request("aborted", PROMPT))
    engine.step()
    engine.scheduler.abort_requests(["aborted"])
    assert engine.scheduler.kv.held, "the load still writes into the aborted request's blocks"
    # The same prompt again must not find those half-loaded blocks in the GPU prefix cache:
    # the fake worker fails the forward of any request that reads them early.
    engine.add(make_request("again", PROMPT))
    engine.run()
    assert engine.results["aborted"].finish_reason == "abort"
    assert engine.results["again"].token_ids == expected_output(PROMPT, 2)
    engine.assert_idle()


def test_abort_during_a_store_holds_its_blocks_until_the_store_lands():
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=32, copy_steps=2)
    request = engine.add(make_request("aborted", PROMPT, max_tokens=8))
    engine.step()
    out, _ = engine.step()
    assert out.kv_connector_metadata.stores
    engine.scheduler.abort_requests(["aborted"])
    assert engine.scheduler.kv.held
    engine.run()
    assert engine.connector.tier.lookup(request.block_hashes) == 5
    engine.assert_idle()


def test_a_block_being_loaded_is_not_loaded_again_for_a_second_request():
    engine = make_engine(num_gpu_blocks=16, num_cpu_blocks=32, copy_steps=1)
    engine.add(make_request("first", PROMPT))
    engine.run()
    evict_from_gpu(engine)
    loader = engine.add(make_request("loader", PROMPT))
    waiter = engine.add(make_request("waiter", PROMPT))
    out, _ = engine.step()
    assert len(out.kv_connector_metadata.loads) == 1
    assert loader.status == RequestStatus.WAITING_FOR_KV and waiter.status == RequestStatus.WAITING
    admitted = {}
    for out, _ in engine.steps():
        admitted |= {new.request_id: new.num_computed_tokens for new in out.new_requests}
    # The waiter asked again once the load landed and hit the loaded blocks on the GPU.
    assert admitted == {"loader": 16, "waiter": 16}
    assert engine.connector.stats.blocks_loaded == 4
    assert engine.results["waiter"].token_ids == expected_output(PROMPT, 2)
    engine.assert_idle()


@pytest.mark.parametrize(
    "policy, factor, num_cpu_blocks", [("lru", 1, 16), ("arc", 1, 16), ("lru", 2, 8), ("arc", 2, 12)]
)
def test_stress_small_cpu_tier_random_aborts_nothing_leaks(policy, factor, num_cpu_blocks):
    rng = random.Random(f"{policy}-{factor}")
    engine = make_engine(
        num_gpu_blocks=24, num_cpu_blocks=num_cpu_blocks, factor=factor, policy=policy,
        copy_steps=2, rng=rng, max_num_batched_tokens=48, max_num_seqs=8,
    )
    prefixes = [[rng.randrange(3, 900) for _ in range(rng.choice((8, 16, 24)))] for _ in range(5)]
    work = {}
    for number in range(200):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 20))]
        work[f"r{number}"] = (prompt, rng.randrange(1, 12))
    pending = list(work)
    evicted = 0
    for _ in range(5000):
        if not pending and not engine.scheduler.has_work():
            break
        for _ in range(rng.randrange(0, 3)):
            if pending:
                request_id = pending.pop(0)
                engine.add(make_request(request_id, *work[request_id]))
        if engine.scheduler.requests and rng.random() < 0.1:
            engine.scheduler.abort_requests([rng.choice(sorted(engine.scheduler.requests))])
        engine.step()
        evicted += sum(isinstance(event, BlockRemoved) for event in engine.connector.take_events())
    engine.assert_idle()
    finished = {rid: r for rid, r in engine.results.items() if r.finish_reason == "length"}
    assert len(finished) > 120 and len(engine.results) == len(work)
    assert engine.connector.stats.blocks_loaded > 0 and evicted > 0 and engine.scheduler.num_preemptions > 0
    for request_id, result in finished.items():
        assert result.token_ids == expected_output(*work[request_id])


def test_the_scheduler_side_leaves_torch_out():
    code = "import sys, connector.offloading_scheduler; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
