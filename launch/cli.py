"""The ``strata`` command line: ``generate``, ``serve``, ``bench``."""

import argparse
import json
import sys

from launch import bench_scheduler


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="A distributed LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    scheduler = bench.add_parser("scheduler", help="scheduler + KV manager cost per step at steady decode")
    scheduler.add_argument("--num-running", type=int, default=1024)
    scheduler.add_argument("--steps", type=int, default=200)
    scheduler.add_argument("--block-size", type=int, default=16)
    scheduler.add_argument("--json", action="store_true", help="print one JSON object")
    scheduler.set_defaults(handler=_bench_scheduler)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.handler(args)


if __name__ == "__main__":
    main(sys.argv[1:])
