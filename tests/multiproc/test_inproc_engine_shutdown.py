"""Shutting down an in-process engine (``--executor uni``) frees what its runner held, so that
a second engine in the same process gets the (GPU) memory."""

import gc
import weakref

from strata import LLM, SamplingParams

from model_factory import tiny_llama_config


def test_shutdown_drops_the_model_kv_cache_and_offload_pool(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path)
    llm = LLM(
        str(tmp_path / "config.json"), load_format="dummy", skip_tokenizer=True, executor="uni",
        dtype="float32", num_gpu_blocks=32, kv_offload_cpu_bytes=1 << 20,
    )
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    runner = llm.engine.core.executor.runner
    held = [weakref.ref(runner.model), weakref.ref(runner.kv_caches[0]), weakref.ref(runner.offload.cpu_pool[0])]
    del runner
    llm.shutdown()
    gc.collect()
    assert [ref() for ref in held] == [None, None, None]
    llm.shutdown()  # a second shutdown does nothing
