"""The ``strata`` command line: ``generate``, ``serve``, ``bench``.

An argparse layer only: each handler turns its flags into the typed objects the command's
module takes. A flag value those objects reject is a usage error: one line, exit status 2.
"""

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from strata.engine_core.sampling_params import SamplingParams, StructuredOutputsParams
from strata.launch.cli import generate
from strata.launch.bench import offload as bench_offload
from strata.launch.bench import scheduler as bench_scheduler
from strata.launch.bench import serve as bench_serve
from strata.launch.bench import soak as bench_soak
from strata.launch.bench import throughput as bench_throughput
from strata.runtime.executors import ray_launcher
from strata.launch.server import serve as server
from strata.runtime.engine_args import EngineArgs
from strata.launch.llm import LLM
from strata.launch.server.app import DEFAULT_MAX_REQUEST_BYTES, PREFIX_CACHE_ISOLATION, AppOptions
from strata.launch.server.reasoning_parsers import REASONING_PARSERS
from strata.launch.server.tool_parsers import TOOL_CALL_PARSERS

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line: the full usage of a command with every engine flag fills a screen."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@contextmanager
def _usage_errors(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Report a ``ValueError`` (a flag value rejected past argparse) as a usage error."""
    try:
        yield
    except ValueError as error:
        parser.error(str(error))


def _start_llm(args: argparse.Namespace) -> LLM:
    return LLM(**dataclasses.asdict(EngineArgs.from_cli(args)))


def _generate(args: argparse.Namespace) -> None:
    with _usage_errors(args.parser):
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            structured_outputs=_structured_outputs(args),
        )
        llm = _start_llm(args)
    with llm:
        generate.run(llm, args.prompt, params, chat=args.chat, as_json=args.json, progress=not args.no_progress)


def _structured_outputs(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The one output constraint of ``strata generate``, if any (a schema is read from its file)."""
    given = {
        "json": _read(args.json_schema, "--json-schema") if args.json_schema else None,
        "regex": args.regex,
        "choice": args.choice,
        "grammar": _read(args.grammar, "--grammar") if args.grammar else None,
    }
    given = {name: value for name, value in given.items() if value is not None}
    if args.json_object:
        given["json_object"] = True
    return StructuredOutputsParams(**given) if given else None


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{flag}: cannot read {path}: {error}") from None


def _bench_throughput(args: argparse.Namespace) -> None:
    with _usage_errors(args.parser):
        workload = bench_throughput.Workload(
            num_prompts=args.num_prompts,
            input_len_min=args.input_len_min,
            input_len_max=args.input_len_max,
            output_len=args.output_len,
            prefix_len=args.prefix_len,
            seed=args.seed,
        )
        llm = _start_llm(args)
    with llm:
        result = bench_throughput.run(llm, workload, args.baseline)
    print(json.dumps(result) if args.json else bench_throughput.format_result(result))


def _serve(args: argparse.Namespace) -> None:
    with _usage_errors(args.parser):
        app = AppOptions(
            served_model_name=args.served_model_name,
            api_keys=tuple(args.api_key or ()),
            prefix_cache_isolation=args.prefix_cache_isolation,
            max_request_bytes=args.max_request_bytes,
            enable_debug_endpoints=args.enable_debug_endpoints,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )
        options = server.ServeOptions(args.host, args.port, args.shutdown_timeout, app)
        engine_args = EngineArgs.from_cli(args)
        # The engine validates the rest (model, executor) as it starts.
        server.run(options, engine_args)


def _bench_serve(args: argparse.Namespace) -> None:
    with _usage_errors(args.parser):
        load = bench_serve.Load(
            url=args.url,
            num_prompts=args.num_prompts,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            max_tokens=args.max_tokens,
            seed=args.seed,
            workload=args.workload,
            tenants=args.tenants,
            system_prompt_words=args.system_prompt_words,
            structured=args.structured,
        )
    result = bench_serve.run(load)
    print(json.dumps(result) if args.json else bench_serve.format_result(result))


def _bench_soak(args: argparse.Namespace) -> None:
    flags = tuple(args.serve_flags[1:] if args.serve_flags[:1] == ["--"] else args.serve_flags)
    soak = bench_soak.Soak(args.duration_s, args.concurrency, args.seed, args.max_rss_growth, args.long_prompt_words, flags)
    result = bench_soak.run(soak)
    print(json.dumps(result) if args.json else bench_soak.format_result(result))
    sys.exit(0 if result["passed"] else 1)


def _bench_offload(args: argparse.Namespace) -> None:
    with _usage_errors(args.parser):
        engine_args = EngineArgs.from_cli(args)
        workload = bench_offload.OffloadWorkload(
            conversations=args.conversations,
            turns=args.turns,
            document_len=args.document_len,
            question_len=args.question_len,
            output_len=args.output_len,
            gpu_blocks=args.gpu_blocks,
            cpu_bytes=args.cpu_bytes,
        )
    result = bench_offload.run(engine_args, workload)
    if args.json:
        print(json.dumps(result))
        return
    for name in ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "prefill_tokens", "offload_hit_rate", "output_tokens_per_s"):
        print(f"{name:22} off {result[name + '_off']:>12.4g}   on {result[name + '_on']:>12.4g}")
    print(
        f"TTFT {result['ttft_ratio']:.2f}x better, {result['prefill_ratio']:.2f}x fewer prefill tokens, "
        f"{result['throughput_ratio']:.2f}x output tokens/s with offload; same outputs: {result['same_outputs']}"
    )


def _bench_scheduler(args: argparse.Namespace) -> None:
    result = bench_scheduler.run(args.num_running, args.steps, args.block_size)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['num_running']} running: {result['us_per_step']:.1f} us/step "
            f"({result['us_per_request']:.3f} us/request), "
            f"{result['bytes_per_step']:.0f} bytes/step ({result['bytes_per_request']:.2f} bytes/request)"
        )


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate",
        help="complete prompts offline",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1 disables top-k")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="send each prompt as a user message via the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt and line")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--json-schema", metavar="FILE", default=None, help="constrain the output to this JSON schema")
    parser.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    parser.add_argument("--regex", default=None, help="constrain the output to this regular expression")
    parser.add_argument("--choice", action="append", default=None, help="constrain the output to one of these (repeat)")
    parser.add_argument("--grammar", metavar="FILE", default=None, help="constrain the output to this Lark-style grammar")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_generate, parser=parser)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", action="append", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (repeat for several)"
    )
    parser.add_argument(
        "--prefix-cache-isolation", default="none", choices=PREFIX_CACHE_ISOLATION,
        help="per-api-key: requests share prefix-cache blocks only with requests made with the same API key",
    )
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help="bigger: 413")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (unset: its dir's)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get on stop")
    parser.add_argument("--enable-debug-endpoints", action="store_true", help="serve GET /debug/state (engine state)")
    parser.add_argument(
        "--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
        help="the model family's tool-call format, read from chat outputs under tool_choice auto",
    )
    parser.add_argument(
        "--reasoning-parser", default=None, choices=REASONING_PARSERS,
        help="split the reasoning (think tags) out of chat and Responses outputs (unset: the output is all answer)",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_serve, parser=parser)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    throughput = bench.add_parser(
        "throughput",
        help="offline generation throughput on a synthetic workload",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    throughput.add_argument("--num-prompts", type=int, default=64)
    throughput.add_argument("--input-len-min", type=int, default=32, help="tokens per prompt after the prefix")
    throughput.add_argument("--input-len-max", type=int, default=512)
    throughput.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    throughput.add_argument("--prefix-len", type=int, default=0, help="tokens of prefix shared by every prompt")
    throughput.add_argument("--baseline", choices=["hf"], default=None, help="also time HF transformers generate")
    throughput.add_argument("--seed", type=int, default=0, help="seeds the workload")
    throughput.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(throughput)
    throughput.set_defaults(handler=_bench_throughput, parser=throughput)

    serve = bench.add_parser(
        "serve",
        help="load a running server with streaming completions (loopback only)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--url", default="http://127.0.0.1:8000", help="the server's root URL")
    serve.add_argument("--num-prompts", type=int, default=64)
    serve.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: at once")
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (unset: no limit)")
    serve.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
    serve.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    serve.add_argument("--workload", default="random", choices=bench_serve.WORKLOADS,
                       help="multi-tenant: long system prompts shared by many short conversations, interleaved")
    serve.add_argument("--tenants", type=int, default=8, help="multi-tenant: system prompts")
    serve.add_argument("--system-prompt-words", type=int, default=400, help="multi-tenant: words per system prompt")
    serve.add_argument("--structured", default=None, choices=bench_serve.STRUCTURED,
                       help="run the load twice, without and with a JSON schema on every request, and compare")
    serve.add_argument("--json", action="store_true", help="print one JSON object")
    serve.set_defaults(handler=_bench_serve, parser=serve)

    soak = bench.add_parser(
        "soak",
        help="strata serve under mixed traffic, then check blocks, invariants and memory growth",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    soak.add_argument("--duration-s", type=float, default=1800.0, help="how long traffic runs")
    soak.add_argument("--concurrency", type=int, default=16, help="clients sending at once")
    soak.add_argument("--seed", type=int, default=0, help="seeds the traffic")
    soak.add_argument("--max-rss-growth", type=float, default=0.05, help="allowed RSS growth after the first fifth")
    soak.add_argument("--long-prompt-words", type=int, default=600, help="words in the longest prompts")
    soak.add_argument("--json", action="store_true", help="print one JSON object")
    soak.add_argument("serve_flags", nargs=argparse.REMAINDER, help="after --: flags for strata serve")
    soak.set_defaults(handler=_bench_soak)

    scheduler = bench.add_parser("scheduler", help="scheduler + KV manager cost per step at steady decode")
    scheduler.add_argument("--num-running", type=int, default=1024)
    scheduler.add_argument("--steps", type=int, default=200)
    scheduler.add_argument("--block-size", type=int, default=16)
    scheduler.add_argument("--json", action="store_true", help="print one JSON object")
    scheduler.set_defaults(handler=_bench_scheduler)

    offload = bench.add_parser("offload", help="multi-turn long-context TTFT with the CPU KV tier off and on")
    defaults = bench_offload.OffloadWorkload()
    for name in ("conversations", "turns", "document_len", "question_len", "output_len", "gpu_blocks", "cpu_bytes"):
        offload.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    offload.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(offload)
    offload.set_defaults(handler=_bench_offload, parser=offload)


def _launch_ray(args: argparse.Namespace) -> None:
    with _usage_errors(args.parser):
        options = ray_launcher.RayNodeOptions(
            head=args.head,
            address=args.address,
            port=args.port,
            node_ip_address=args.node_ip_address,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            temp_dir=args.temp_dir,
            dashboard=args.dashboard,
            block=args.block,
            disable_auth=args.disable_auth,
            ray_start_args=args.ray_start_args,
        )
    try:
        sys.exit(ray_launcher.launch(options))
    except ray_launcher.LaunchError as error:
        sys.exit(f"{args.parser.prog}: error: {error}")


def _add_launch(commands: argparse._SubParsersAction) -> None:
    launch = commands.add_parser("launch", help="start cluster nodes").add_subparsers(dest="launch", required=True)
    ray = launch.add_parser(
        "ray",
        help="start this machine's Ray node (ray start) for --executor ray",
        description="Run on the head with --head, on every other node with --address HEAD:PORT. "
        "Flags after -- go to `ray start` unchanged.",
    )
    role = ray.add_mutually_exclusive_group(required=True)
    role.add_argument("--head", action="store_true", help="start the head node")
    role.add_argument("--address", default=None, help="join the head at HEAD:PORT")
    port_help = f"the head's GCS port (default {ray_launcher.DEFAULT_PORT})"
    ray.add_argument("--port", type=int, default=None, help=port_help)
    ray.add_argument("--node-ip-address", default=None, help="the address other nodes reach this one at")
    ray.add_argument("--num-cpus", type=int, default=None, help="CPUs to offer (default: all)")
    ray.add_argument("--num-gpus", type=int, default=None, help="GPUs to offer (default: all)")
    ray.add_argument("--temp-dir", default=None, help="Ray's session and log directory")
    ray.add_argument("--dashboard", action="store_true", help="start Ray's dashboard (on 127.0.0.1)")
    ray.add_argument("--block", action="store_true", help="stay in the foreground; stop the node on Ctrl-C/SIGTERM")
    ray.add_argument("--disable-auth", action="store_true", help="no token authentication: only on trusted networks")
    ray.add_argument("ray_start_args", nargs="*", help="further `ray start` flags, after --")
    ray.set_defaults(handler=_launch_ray, parser=ray)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="strata", description="A distributed LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands)
    _add_serve(commands)
    _add_bench(commands)
    _add_launch(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.handler(args)

