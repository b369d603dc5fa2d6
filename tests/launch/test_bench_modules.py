"""The benchmarks run as ``python -m strata.launch.bench.<name>`` import and answer ``--help``;
the vLLM comparison's driver starts where only the standard library is and counts its engine's
processes' memory; ``dp_routing`` reads
its command line as ``dp_routing.sh`` did. Nothing here runs an engine."""

import importlib
import subprocess
import sys

import pytest

from strata.launch.bench import compare_vllm_driver
from strata.launch.bench import multinode
from strata.launch.bench.dp_routing import DEFAULT_LOAD, DEFAULT_POLICIES, parse_args
from strata.launch.cli.main import build_parser

MODULES = (
    "compare_vllm", "compare_vllm_serve", "compare_vllm_driver", "step_profile", "dp_routing", "speculative",
    "memory_bound", "multinode", "netns_cluster", "pipeline", "decode_attention", "cache_perplexity",
)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_answers_help(name, monkeypatch, capsys):
    module = importlib.import_module(f"strata.launch.bench.{name}")
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_vllm_driver_starts_without_strata_or_any_installed_package():
    # -I -S: neither site-packages nor the script's folder on sys.path, as for vLLM's interpreter.
    command = [sys.executable, "-I", "-S", compare_vllm_driver.__file__, "--help"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_vllm_driver_counts_the_memory_of_the_engine_processes_under_it():
    # An engine's EngineCore and workers, not the driver, hold its weights and KV cache.
    before = compare_vllm_driver.resident_mib()
    holder = (
        "import sys; held = bytearray(256 << 20); held[::4096] = bytes(len(held[::4096]));"
        "print(1, flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "1\n"
        assert compare_vllm_driver.resident_mib() - before > 250
    finally:
        child.communicate(timeout=30)


def test_dp_routing_runs_every_policy_on_the_default_load_unless_told_otherwise():
    args = parse_args(["72"])
    assert (args.num_gpu_blocks, args.policies, args.bench_flags) == (72, list(DEFAULT_POLICIES), list(DEFAULT_LOAD))
    args = parse_args(["256", "cache-aware", "round-robin", "--", "--num-prompts", "8"])
    assert (args.policies, args.bench_flags) == (["cache-aware", "round-robin"], ["--num-prompts", "8"])


def test_dp_routing_default_load_is_a_bench_serve_command_line():
    args = build_parser().parse_args(["bench", "serve", *DEFAULT_LOAD])
    assert (args.workload, args.tenants, args.num_prompts) == ("multi-tenant", 8, 96)


def test_dp_routing_rejects_an_unknown_policy(capsys):
    with pytest.raises(SystemExit):
        parse_args(["72", "fastest"])
    assert "'fastest' is not a policy" in capsys.readouterr().err


def test_multinode_passes_the_flags_after_a_double_dash_to_strata_serve():
    args = multinode.parse_args(["--max-tokens", "8", "--", "--max-num-seqs", "4"])
    assert (args.max_tokens, args.serve_flags) == (8, ["--max-num-seqs", "4"])
