"""``strata bench throughput``: offline generation throughput on a synthetic workload, optionally
against HF transformers' ``generate`` on the same prompts in the same process.

The workload is deterministic for a seed. Every prompt is a slice of English prose (``CORPUS``,
tokenised with the model's tokenizer and read cyclically): an optional shared prefix of
``prefix_len`` tokens, then its own part of ``input_len_min..input_len_max`` tokens (uniform)
starting at its own position in the text (positions repeat only past one prompt per corpus
token), so that prompts share no cached KV block beyond the prefix. Every request generates
exactly ``output_len`` tokens, greedily and ignoring EOS.
"""

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from strata.engine_core.sampling_params import SamplingParams
from strata.runtime.core_client import SyncCoreClient
from strata.launch.llm import LLM
from strata.worker.model_loader import resolve_dtype

COPY_CHARS = 1200  # the copy workload's passage (speculative decoding's benchmark)
COPY_TOKENS = 256
HF_BATCH_SIZE = 64
WARMUP_PROMPT_LEN = 64
WARMUP_OUTPUT_LEN = 4

CORPUS = """\
The harbour town wakes before the sun does. Long before the first ferry sounds its horn, the \
bakers on the hill have lit their ovens, and the smell of bread drifts down the narrow streets \
toward the water. Fishermen check their nets by lamplight, trading news about the weather and the \
price of diesel, while gulls wait on the railings with the patience of creatures who know that \
something will eventually be dropped. By six o'clock the market square is full of crates, and by \
seven it is full of people.

Most visitors come for the lighthouse, a white tower on a spit of rock at the end of the eastern \
breakwater. It was built in the middle of the nineteenth century, after a winter in which three \
ships ran aground within sight of the quay. The first keeper was a retired sailor who kept a \
journal of every storm, every passing vessel and every repair he made to the lamp. His entries \
are short and practical, but now and then a sentence escapes the routine: a note about the colour \
of the sea after rain, or about a seal that slept on the lowest step for most of one October.

The lamp itself has changed many times. Whale oil gave way to paraffin, paraffin to gas, and gas \
to electricity, and each change was greeted by the older keepers with suspicion. The great glass \
lens, however, has stayed the same. It stands taller than a person and is made of concentric \
rings of prisms that bend the light into a single horizontal beam. On a clear night the beam can \
be seen from more than twenty miles away, sweeping across the water once every ten seconds, a \
rhythm that sailors learned to recognise as the signature of this particular coast.

Keeping a light was never only about the lamp. The keepers painted, scraped, oiled and polished; \
they recorded the wind and the pressure three times a day; they rowed out to ships in trouble \
when no one else could. Their families lived with them in the low cottages at the foot of the \
tower, and the children walked along the breakwater to school in all but the worst weather. One \
of those children later became the town's schoolteacher, and she made every class she taught \
climb the hundred and twelve steps at least once, so that they would understand what the view \
had cost.

Automation arrived quietly. In the last decades of the twentieth century a set of sensors, \
batteries and switches took over the work of the keepers, and a technician from the city began \
to visit twice a year. The cottages were sold, then rented to holidaymakers, then bought back by \
a local trust that turned one of them into a small museum. It holds the first keeper's journals, \
a brass telescope, a collection of photographs of wrecks, and a chair that visitors are not \
allowed to sit in, although many of them do.

In the evening the town turns back toward the sea. Restaurants put their tables out along the \
quay, the ferry returns with its last passengers, and the fishermen mend whatever the day has \
broken. When the light comes on, people still look up, even those who have seen it every night \
of their lives. There is something steadying about a thing that does the same work, in the same \
place, for longer than anyone can remember, and asks for nothing except to be kept.
"""


@dataclass(frozen=True)
class Workload:
    """The synthetic requests: how many, how long their prompts and outputs are, and the seed."""

    num_prompts: int = 64
    input_len_min: int = 32
    input_len_max: int = 512
    output_len: int = 128
    prefix_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not 1 <= self.input_len_min <= self.input_len_max:
            raise ValueError(
                f"need 1 <= input_len_min <= input_len_max, got {self.input_len_min} and {self.input_len_max}"
            )
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")


def copy_prompt(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The copy workload's chat prompt: repeat a passage of the corpus word for word."""
    message = {"role": "user", "content": f"Repeat the following text word for word.\n\n{CORPUS[:COPY_CHARS]}"}
    return tokenizer.apply_chat_template([message], add_generation_prompt=True, tokenize=True, return_dict=False)


def synthetic_prompts(corpus: Sequence[int], workload: Workload) -> list[list[int]]:
    """The workload's prompts as token ids, cut from ``corpus`` (read cyclically)."""
    rng = random.Random(workload.seed)
    prefix = cyclic_slice(corpus, rng.randrange(len(corpus)), workload.prefix_len)
    starts = rng.sample(range(len(corpus)), len(corpus))
    return [
        prefix + cyclic_slice(corpus, starts[i % len(starts)], rng.randint(workload.input_len_min, workload.input_len_max))
        for i in range(workload.num_prompts)
    ]


def cyclic_slice(tokens: Sequence[int], start: int, length: int) -> list[int]:
    return [tokens[(start + i) % len(tokens)] for i in range(length)]


def run(llm: LLM, workload: Workload, baseline: str | None = None) -> dict[str, object]:
    """Time the engine on the workload; with ``baseline="hf"``, time HF transformers' ``generate``
    on the same prompts too. Each gets the same short warm-up first; model loading is not timed."""
    if baseline not in (None, "hf"):
        raise ValueError(f"baseline must be 'hf' or None, got {baseline!r}")
    if llm.tokenizer is None:
        raise ValueError("bench throughput cuts its prompts from text: pass --tokenizer DIR, not --skip-tokenizer")
    corpus = llm.tokenizer.encode(CORPUS, add_special_tokens=False)
    prompts = synthetic_prompts(corpus, workload)
    warmup = [corpus[::-1][:WARMUP_PROMPT_LEN]]  # reversed text: shares no cached block with the prompts
    dtype, _ = resolve_dtype(llm.config.worker.dtype, llm.config.worker.device)

    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True), use_tqdm=False)
    before = llm.stats
    elapsed = _time_engine(llm, prompts, workload.output_len)
    input_tokens = sum(len(prompt) for prompt in prompts)
    output_tokens = len(prompts) * workload.output_len
    output_tokens_per_s = output_tokens / elapsed
    result: dict[str, object] = {
        **dataclasses.asdict(workload),
        "executor": llm.args.executor,
        "tensor_parallel_size": llm.args.tensor_parallel_size,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": llm.args.kv_cache_dtype,
        "device": llm.config.worker.device,
        "num_threads": torch.get_num_threads(),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": output_tokens_per_s,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
    }
    if llm.args.speculative_method is not None and before is not None and llm.stats is not None:
        drafts = llm.stats.spec_draft_tokens - before.spec_draft_tokens
        accepted = llm.stats.spec_accepted_tokens - before.spec_accepted_tokens
        verifications = llm.stats.spec_verifications - before.spec_verifications
        result["spec_draft_tokens"] = drafts
        result["spec_accepted_tokens"] = accepted
        result["spec_acceptance"] = accepted / drafts if drafts else 0.0
        result["spec_tokens_per_verification"] = 1 + accepted / verifications if verifications else 1.0
    if isinstance(llm.engine, SyncCoreClient):
        # Encode + send + receive + decode between the EngineCore and its workers, per step.
        result["ipc_us_per_step"] = llm.engine.call_utility("debug_state")["ipc_us_per_step"]
    if baseline == "hf":
        pad_token_id = llm.tokenizer.pad_token_id
        if pad_token_id is None:
            pad_token_id = llm.tokenizer.eos_token_id
        baseline_elapsed = _time_hf_generate(
            llm.config.model_path, dtype, llm.config.worker.device, pad_token_id, prompts, workload.output_len, warmup
        )
        baseline_output_tokens_per_s = output_tokens / baseline_elapsed
        result["baseline"] = "hf"
        result["baseline_elapsed_s"] = baseline_elapsed
        result["baseline_output_tokens_per_s"] = baseline_output_tokens_per_s
        result["ratio"] = output_tokens_per_s / baseline_output_tokens_per_s
    return result


def _time_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Seconds the engine takes to generate ``output_len`` greedy tokens for every prompt."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for output in outputs:
        completion = output.outputs[0]
        if len(completion.token_ids) != output_len:
            raise RuntimeError(
                f"request {output.request_id} generated {len(completion.token_ids)} of {output_len} tokens "
                f"({completion.finish_reason}: {completion.error})"
            )
    return elapsed


def _time_hf_generate(
    model_path: Path,
    dtype: torch.dtype,
    device: str,
    pad_token_id: int,
    prompts: list[list[int]],
    output_len: int,
    warmup: list[list[int]],
) -> float:
    """Seconds HF ``generate`` takes for ``output_len`` greedy tokens per prompt, in left-padded
    batches of ``HF_BATCH_SIZE`` (after the same warm-up as the engine's)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True).to(device).eval()

    def generate(batch: list[list[int]], length: int) -> None:
        width = max(len(prompt) for prompt in batch)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        sequences = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            min_new_tokens=length,
            max_new_tokens=length,
            pad_token_id=pad_token_id,
        )
        if sequences.shape[1] != width + length:
            raise RuntimeError(f"HF generate made {sequences.shape[1] - width} of {length} tokens")

    with torch.inference_mode():
        generate(warmup, WARMUP_OUTPUT_LEN)
        start = time.perf_counter()
        for first in range(0, len(prompts), HF_BATCH_SIZE):
            generate(prompts[first : first + HF_BATCH_SIZE], output_len)
        return time.perf_counter() - start


def format_result(result: dict[str, object]) -> str:
    """``run``'s figures for a person to read."""
    lines = [
        f"engine ({result['executor']}, tp={result['tensor_parallel_size']}, {result['dtype']}, "
        f"KV cache {result['kv_cache_dtype']}): "
        f"{result['num_prompts']} requests in {result['elapsed_s']:.2f} s, {result['requests_per_s']:.2f} requests/s, "
        f"{result['output_tokens_per_s']:.1f} output tokens/s, {result['total_tokens_per_s']:.1f} total tokens/s"
    ]
    if "spec_draft_tokens" in result:
        lines.append(
            f"speculative decoding: {result['spec_acceptance']:.0%} of {result['spec_draft_tokens']} drafts accepted, "
            f"{result['spec_tokens_per_verification']:.2f} tokens per verified step"
        )
    if "baseline" in result:
        lines.append(
            f"{result['baseline']} generate: {result['baseline_elapsed_s']:.2f} s, "
            f"{result['baseline_output_tokens_per_s']:.1f} output tokens/s; "
            f"engine/{result['baseline']} = {result['ratio']:.2f}x"
        )
    return "\n".join(lines)
