"""``strata generate``: complete prompts offline and print one completion per prompt."""

import json

from strata.engine_core.sampling_params import SamplingParams
from strata.launch.llm import LLM
from strata.launch.outputs import RequestOutput


def run(llm: LLM, prompts: list[str], params: SamplingParams, *, chat: bool, as_json: bool, progress: bool) -> None:
    """Complete ``prompts`` and print them in order: as text, or as one JSON object a line.

    With ``chat`` each prompt is one user message, sent through the model's chat template.
    """
    if chat:
        conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=progress)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=progress)
    for prompt, output in zip(prompts, outputs):
        print(format_json(prompt, output) if as_json else format_text(prompt, output), flush=True)


def format_json(prompt: str, output: RequestOutput) -> str:
    """One line: ``prompt``, ``text``, ``token_ids``, ``finish_reason`` (and ``error``, if any)."""
    completion = output.outputs[0]
    record = {
        "prompt": prompt,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
    }
    if completion.error is not None:
        record["error"] = completion.error
    return json.dumps(record)


def format_text(prompt: str, output: RequestOutput) -> str:
    """The prompt and its completion (or error) as quoted strings, then a blank line."""
    completion = output.outputs[0]
    result = f"Error: {completion.error}" if completion.error is not None else f"Output: {completion.text!r}"
    return f"Prompt: {prompt!r}\n{result}\n"
