"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``."""

import gc
import itertools
from collections.abc import Sequence

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from strata.engine_core.protocol import SchedulerStats
from strata.engine_core.sampling_params import SamplingParams
from strata.runtime.core_client import SyncCoreClient
from strata.runtime.data_parallel.replicas import SyncDPClient
from strata.runtime.engine_args import EngineArgs, ResolvedConfig, resolve
from strata.runtime.inproc_client import InprocClient
from strata.launch.lora_registry import LoRARegistry, LoRARequest
from strata.launch.output_processor import OutputProcessor
from strata.launch.outputs import RequestOutput
from strata.launch.prompts import encode_chat, encode_text
from strata.launch.tokenizer import load_tokenizer

Prompt = str | list[int]
Message = dict[str, str]


def start_engine(args: EngineArgs, resolved: ResolvedConfig) -> InprocClient | SyncCoreClient | SyncDPClient:
    """The client ``LLM`` drives: data-parallel replicas, the EngineCore in this process
    (``--executor uni``), or an EngineCore process with its workers. Processes are started,
    not yet ready: call ``wait_ready`` before anything else."""
    if args.data_parallel_size > 1:
        return SyncDPClient(args, resolved)
    if args.executor == "uni":
        return InprocClient.start(resolved)
    return SyncCoreClient(resolved, wait_ready=False)


class LLM:
    """An engine for offline batches. ``model=None`` loads the default model (SmolLM2-135M-
    Instruct); other keyword arguments are ``EngineArgs`` fields (``executor``, ``dtype``,
    ``max_num_seqs``, ...). Once ready it freezes the process's objects out of the cyclic garbage
    collector (``gc.freeze()``): cycles among objects that existed then are freed only after
    ``gc.unfreeze()``."""

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        self.args = EngineArgs(model=model, **engine_args)
        self.config = resolve(self.args)
        self.loras = LoRARegistry.start(self.args, self.config)  # a bad --lora-modules stops here
        self.engine = start_engine(self.args, self.config)
        try:
            # Loaded here while the engine's processes start theirs (seconds of imports each).
            self.tokenizer = load_tokenizer(self.config.tokenizer_path)
            self.engine.wait_ready()
        except BaseException:
            self.engine.shutdown()
            raise
        self.processor = OutputProcessor.for_model(self.tokenizer, self.config.model_path)
        self._ids = itertools.count()
        self.stats: SchedulerStats | None = None  # as of the last step
        gc.freeze()  # the tokenizer and the engine's start-up objects: full collections skip them

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); outputs come back in prompt order. Text
        is encoded with the tokenizer's default special tokens (a BOS where it adds one). With
        ``cache_salt``, these prompts share cached KV blocks only with requests that carry the
        same salt (tenant isolation of the prefix cache). With ``lora_request`` (one for every
        prompt, or a list with one per prompt, None for the base model), they run with that LoRA
        adapter, loaded at its first use (the engine needs ``enable_lora=True``)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of those, got {type(prompts).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if not isinstance(sampling_params, Sequence) or not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if not isinstance(lora_request, Sequence) or not all(r is None or isinstance(r, LoRARequest) for r in lora_request):
            raise TypeError("lora_request must be a LoRARequest or a list of them (None: the base model)")
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(lora_request)} lora_requests for {len(prompts)} prompts")
        loras = [None if request is None else self.loras.for_request(request) for request in lora_request]
        # Every prompt is checked and registered before any reaches the engine: a bad one
        # raises with nothing left behind.
        request_ids: list[str] = []
        requests = []
        try:
            for prompt, params, lora in zip(prompts, sampling_params, loras):
                text, token_ids = self._encode(prompt)
                request_id = str(next(self._ids))
                requests += self.processor.add_request(
                    request_id, text, token_ids, params, cache_salt=cache_salt, lora=lora, stream=False
                )
                request_ids.append(request_id)
        except (TypeError, ValueError):
            for request_id in request_ids:
                self.processor.forget(request_id)
                self.processor.outputs.pop(request_id)
            raise
        for request in requests:
            self.engine.add_request(request)
        self._run(request_ids, use_tqdm)
        return [self.processor.pop_finished(request_id) for request_id in request_ids]

    def _encode(self, prompt: object) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            token_ids = encode_text(self._require_tokenizer(), prompt)
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids, text = list(prompt), None
        else:
            raise TypeError("prompts: a prompt is a string or a list of integer token ids")
        if not token_ids:
            raise ValueError("prompts: a prompt must not be empty")
        return text, token_ids

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self._require_tokenizer()
        token_ids = [encode_chat(tokenizer, conversation) for conversation in conversations]
        return self.generate(token_ids, sampling_params, use_tqdm=use_tqdm)

    def _require_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise ValueError("text prompts and chat need a tokenizer: this LLM was made with skip_tokenizer=True")
        return self.tokenizer

    def _run(self, request_ids: list[str], use_tqdm: bool) -> None:
        pending = set(request_ids)
        # disable=None: no bar at all when stderr is not a terminal (a log file); at most two
        # redraws a second when it is.
        bar = tqdm(total=len(request_ids), disable=None if use_tqdm else True, mininterval=0.5, desc="Generating")
        with bar as progress:
            while pending:
                outputs = self.engine.get_output()
                self.stats = outputs.stats or self.stats
                deltas, to_abort = self.processor.process(outputs)
                if to_abort:
                    self.engine.abort_requests(to_abort)
                done = {d.request_id for d in deltas if d.finish_reason} & pending
                done = {request_id for request_id in done if self.processor.outputs[request_id].finished}
                pending -= done
                progress.update(len(done))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (as vLLM's ``LLM.reset_prefix_cache``), e.g. between
        timed runs of a benchmark, so that no run reuses the KV of an earlier one."""
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
