"""lm-evaluation-harness's ``local-completions`` model against ``strata serve`` on a local
multiple-choice task (benchmarks/lm_eval_task): its loglikelihood requests succeed, its
per-choice scores are the engine's own prompt logprobs, and it picks what HF transformers'
logprobs pick."""

import importlib.util
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from server_helpers import running_server
from strata.worker.model_loader import resolve_model_path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval_vs_hf.py"
TOLERANCE = 1e-3


def load_benchmark():
    spec = importlib.util.spec_from_file_location("lm_eval_vs_hf", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_benchmark()


@pytest.fixture(scope="module")
def server(log_dir):
    with running_server(log_dir, "--dtype", "float32") as server:
        yield server


@pytest.fixture(scope="module")
def harness(bench, server, model, tmp_path_factory):
    return bench.run_lm_eval(server.url, model, resolve_model_path(None), tmp_path_factory.mktemp("lm-eval"))


def engine_choice_logprobs(bench, server, model: str) -> list[list[float]]:
    """Per question and choice, the sum of the choice's prompt logprobs from the engine."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    scores = []
    for question in bench.questions():
        row = []
        for choice in question["choices"]:
            context, continuation = bench.encode_pair(tokenizer, bench.context_of(question), " " + choice)
            body = {"model": model, "prompt": context + continuation, "max_tokens": 0, "prompt_logprobs": 0}
            entries = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
            row.append(sum(entries[p][str(token)]["logprob"] for p, token in enumerate(continuation, start=len(context))))
        scores.append(row)
    return scores


def test_lm_eval_scores_are_the_engines_own_prompt_logprobs(bench, server, model, harness):
    expected = engine_choice_logprobs(bench, server, model)
    assert len(harness.choice_logprobs) == len(expected) == len(bench.questions())
    for scores, own in zip(harness.choice_logprobs, expected):
        assert scores == pytest.approx(own, abs=TOLERANCE)


def test_lm_eval_picks_what_hf_transformers_picks(bench, harness):
    reference = bench.hf_scores(resolve_model_path(None))
    assert harness.picks == reference.picks
    assert harness.accuracy == reference.accuracy
