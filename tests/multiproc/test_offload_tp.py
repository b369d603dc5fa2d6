"""The CPU offload tier across two tensor-parallel ranks: same tokens, and a transfer counts as
finished only when every rank has finished its shard."""

from transformers import AutoTokenizer

from strata.engine_core.protocol import KVConnectorOutput
from strata import LLM, SamplingParams
from strata.runtime.executors.zmq_executor import TransferTally

OFFLOAD_BYTES = 256 * 1024 * 1024


def test_transfer_slow_on_one_rank_is_not_finished_until_both_report_it():
    tally = TransferTally(size=2)
    fast_rank = KVConnectorOutput(finished_sending=["store-1"], finished_recving=["load-1"], bytes_moved=100)
    assert tally.merge([fast_rank, None]).finished_sending == []
    step_2 = tally.merge([None, KVConnectorOutput(finished_sending=["store-1"], bytes_moved=50)])
    assert (step_2.finished_sending, step_2.finished_recving, step_2.bytes_moved) == (["store-1"], [], 50)
    step_3 = tally.merge([None, KVConnectorOutput(finished_recving=["load-1"])])
    assert step_3.finished_recving == ["load-1"]
    assert tally.merge([None, None]) is None


def test_tp2_greedy_tokens_equal_with_offload_on_and_off(default_model_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    document = tokenizer.encode("The committee met again on Tuesday to review the budget. " * 30, add_special_tokens=False)
    prompts = [document + tokenizer.encode(f" Point {i}:", add_special_tokens=False) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for offload in (None, OFFLOAD_BYTES):
        with LLM(executor="mp", tensor_parallel_size=2, dtype="float32", block_size=16, num_gpu_blocks=30,
                 kv_offload_cpu_bytes=offload) as llm:
            # Alternate with a distractor so the document's GPU blocks are evicted in between.
            tokens[offload] = [
                llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
                for prompt in (prompts[0], document[::-1], prompts[1], document[::-1], prompts[2])
            ]
            if offload:
                assert llm.stats.offload_hit_tokens > 0 and llm.stats.offload_bytes_moved > 0
    assert tokens[OFFLOAD_BYTES] == tokens[None]
