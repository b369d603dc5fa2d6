"""lm-evaluation-harness against ``strata serve`` on a local multiple-choice task, beside HF
transformers scoring the same prompts: accuracy, the choices picked, and wall time.

    python benchmarks/lm_eval_vs_hf.py [--dtype float32] [--json OUT]

lm-eval's ``local-completions`` model sends each (question, choice) as token ids with
``echo: true, logprobs: 1, max_tokens: 1`` and sums the logprobs of the choice's tokens. HF
scores the same token ids in float32, one forward per (question, choice). Needs the ``test``
extra (lm-eval); runs offline.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASK = "strata_mc"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclass
class Scores:
    """Per question, the summed logprob of each choice's tokens; the pick is the best."""

    choice_logprobs: list[list[float]]
    answers: list[int]

    @property
    def picks(self) -> list[int]:
        return [max(range(len(scores)), key=scores.__getitem__) for scores in self.choice_logprobs]

    @property
    def accuracy(self) -> float:
        return sum(pick == answer for pick, answer in zip(self.picks, self.answers)) / len(self.answers)


def questions() -> list[dict]:
    return [json.loads(line) for line in (TASK_DIR / "questions.jsonl").read_text().splitlines()]


def context_of(question: dict) -> str:
    return f"Question: {question['question']}\nAnswer:"


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's and the continuation's token ids, split as lm-eval splits them: the
    whole text is encoded once and the context's own encoding decides where the cut is."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    cut = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    return whole[:cut], whole[cut:]


def run_lm_eval(base_url: str, model_name: str, tokenizer_path: Path, output_dir: Path) -> Scores:
    """Run the ``lm_eval`` CLI (this interpreter's) on the task against ``base_url``."""
    model_args = ",".join([
        f"model={model_name}", f"base_url={base_url}/v1/completions", f"tokenizer={tokenizer_path}",
        "tokenizer_backend=huggingface", "num_concurrent=1", "max_retries=1",
    ])
    command = [
        sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
        "--tasks", TASK, "--include_path", str(TASK_DIR), "--output_path", str(output_dir), "--log_samples",
    ]
    subprocess.run(command, cwd=TASK_DIR, env={**os.environ, **OFFLINE}, check=True, capture_output=True, text=True)
    (samples,) = output_dir.rglob(f"samples_{TASK}_*.jsonl")
    records = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
    return Scores(
        [[float(loglikelihood) for loglikelihood, _ in record["filtered_resps"]] for record in records],
        [record["doc"]["answer"] for record in records],
    )


def hf_scores(model_path: Path) -> Scores:
    """The same scores from HF transformers in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    choice_logprobs = []
    for question in questions():
        row = []
        for choice in question["choices"]:
            context, continuation = encode_pair(tokenizer, context_of(question), " " + choice)
            ids = torch.tensor([context + continuation])
            with torch.inference_mode():
                logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            positions = torch.arange(len(context) - 1, ids.shape[1] - 1)
            row.append(float(logprobs[positions, ids[0, len(context):]].sum()))
        choice_logprobs.append(row)
    return Scores(choice_logprobs, [question["answer"] for question in questions()])


@dataclass
class Report:
    cpu: str
    dtype: str
    lm_eval_accuracy: float
    hf_accuracy: float
    same_picks: bool
    max_score_difference: float
    lm_eval_wall_s: float
    hf_wall_s: float


def main() -> None:
    from strata.launch.bench.compare_vllm import CpuInfo
    from strata.launch.bench.server_process import ServerProcess, free_port, strata_serve_command
    from strata.worker.model_loader import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", help="the server's dtype (HF always scores in float32)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    model_path = resolve_model_path(None)
    port = free_port()
    with ServerProcess(strata_serve_command(port, ["--dtype", args.dtype]), port) as server, tempfile.TemporaryDirectory() as out:
        server.wait_healthy()
        model_name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        started = time.perf_counter()
        harness = run_lm_eval(server.url, model_name, model_path, Path(out))
        lm_eval_wall = time.perf_counter() - started
    started = time.perf_counter()
    reference = hf_scores(model_path)
    hf_wall = time.perf_counter() - started
    report = Report(
        cpu=CpuInfo.read().describe(), dtype=args.dtype,
        lm_eval_accuracy=harness.accuracy, hf_accuracy=reference.accuracy, same_picks=harness.picks == reference.picks,
        max_score_difference=max(
            abs(a - b) for row, ref in zip(harness.choice_logprobs, reference.choice_logprobs) for a, b in zip(row, ref)
        ),
        lm_eval_wall_s=round(lm_eval_wall, 2), hf_wall_s=round(hf_wall, 2),
    )
    print(json.dumps(asdict(report), indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2))


if __name__ == "__main__":
    main()
