"""The CI variant of ``strata bench soak``: 15 s of mixed traffic against a tiny model, then
every block free, invariants intact, no unexpected answer, and bounded memory growth (loose:
a 15 s run is mostly warm-up; the 30-minute run in docs/reliability.md holds 5%)."""

from transformers import AutoTokenizer

from strata.launch.bench.soak import Soak, run
from strata.worker.model_loader import resolve_model_path

from model_factory import save_tiny_model, tiny_llama_config


def test_short_soak_leaves_every_block_free_and_nothing_unexpected(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    save_tiny_model(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=512), tmp_path)
    tokenizer.save_pretrained(tmp_path)
    flags = ("--model", str(tmp_path), "--dtype", "float32", "--num-gpu-blocks", "48", "--max-num-seqs", "16")
    result = run(Soak(duration_s=15, concurrency=6, max_rss_growth=0.5, long_prompt_words=120, serve_flags=flags))
    assert sum(result["requests_sent"].values()) > 20
    assert result["unexpected_outcomes"] == 0, result["failures"]
    state = result["final_state"]
    assert state["num_requests"] == 0 and state["num_free_blocks"] == state["num_blocks"] == 48
    assert state["invariants"] == "ok"
    assert result["passed"], result["failures"]
