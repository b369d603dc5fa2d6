"""Each engine flag is declared once, as an EngineArgs field: the command line, the checks and
the worker's config all follow from it."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from strata.runtime.engine_args import EngineArgs, resolve
from strata.worker import attention
from strata.worker.config import ATTENTION_BACKENDS, WorkerConfig
from model_factory import tiny_llama_config


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


def test_every_field_is_a_flag_defaulting_to_the_fields_default() -> None:
    assert vars(engine_parser().parse_args([])) == dataclasses.asdict(EngineArgs())


def test_flag_values_are_parsed_into_the_fields_types() -> None:
    args = engine_parser().parse_args(
        ["-tp", "2", "--max-model-len", "64", "--worker-timeout-s", "1.5", "--no-enable-prefix-caching"]
    )
    engine = EngineArgs.from_cli(args)
    assert (engine.tensor_parallel_size, engine.max_model_len, engine.worker_timeout_s) == (2, 64, 1.5)
    assert engine.enable_prefix_caching is False


def test_a_value_outside_the_choices_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        EngineArgs(dtype="fp8")


def test_a_value_breaking_the_fields_rule_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="dp_load_margin must be >= 0, got -1"):
        EngineArgs(dp_load_margin=-1)


def test_none_is_refused_where_the_default_is_a_value() -> None:
    with pytest.raises(ValueError, match="executor must be one of uni, mp, ray, got None"):
        EngineArgs(executor=None)


def test_the_attention_backend_choices_are_the_workers_backends() -> None:
    assert set(ATTENTION_BACKENDS) == set(attention._BACKENDS)


def test_the_worker_config_gets_every_flag_it_shares(tmp_path: Path) -> None:
    tiny_llama_config().save_pretrained(tmp_path)
    args = EngineArgs(
        model=str(tmp_path), load_format="dummy", skip_tokenizer=True, dtype="bfloat16", cpu_bf16_linear="native",
        device="cpu", tensor_parallel_size=2, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=128,
        block_size=32, kv_cache_memory=1 << 20, num_gpu_blocks=40, gpu_memory_utilization=0.5, enforce_eager=True,
        cuda_graph_sizes=[1, 2], attention_backend="torch", kv_offload_cpu_bytes=1 << 22, kv_offload_block_size=64,
    )
    assert resolve(args).worker == WorkerConfig(
        model=str(tmp_path), load_format="dummy", dtype="bfloat16", cpu_bf16_linear="native", device="cpu",
        tensor_parallel_size=2, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=128, block_size=32,
        kv_cache_memory=1 << 20, num_gpu_blocks=40, gpu_memory_utilization=0.5, enforce_eager=True,
        cuda_graph_sizes=[1, 2], attention_backend="torch", kv_offload_cpu_bytes=1 << 22, kv_offload_block_size=64,
    )


def test_pipeline_parallelism_on_the_uni_executor_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--pipeline-parallel-size needs --executor mp or ray"):
        EngineArgs(executor="uni", pipeline_parallel_size=2)


def test_a_layer_partition_that_the_model_cannot_fill_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    tiny_llama_config(num_hidden_layers=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"partition \[1, 2\] must give each of the 2 stages"):
        resolve(EngineArgs(model=str(tmp_path), skip_tokenizer=True, pipeline_parallel_size=2, pipeline_layer_partition=[1, 2]))


def test_a_family_whose_decoder_cannot_be_split_is_refused_naming_the_flag(tmp_path: Path) -> None:
    from model_factory import tiny_gemma3_config

    tiny_gemma3_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Gemma3ForCausalLM does not support --pipeline-parallel-size > 1"):
        resolve(EngineArgs(model=str(tmp_path), skip_tokenizer=True, pipeline_parallel_size=2))


def test_lora_flags_resolve_into_the_scheduler_and_worker_configs(tmp_path: Path) -> None:
    tiny_llama_config().save_pretrained(tmp_path)
    parsed = engine_parser().parse_args(
        ["--lora-modules", "sql=/a", "chat=/b", "--max-loras", "3", "--max-lora-rank", "8", "--max-cpu-loras", "5"]
    )
    args = EngineArgs.from_cli(parsed)
    assert args.lora_module_paths() == {"sql": "/a", "chat": "/b"}
    resolved = resolve(dataclasses.replace(args, model=str(tmp_path), skip_tokenizer=True, device="cpu"))
    assert resolved.scheduler.max_loras == 3
    worker = resolved.worker
    assert (worker.enable_lora, worker.max_loras, worker.max_lora_rank, worker.max_cpu_loras) == (True, 3, 8, 5)


def test_without_lora_flags_the_scheduler_has_no_adapter_slots(tmp_path: Path) -> None:
    tiny_llama_config().save_pretrained(tmp_path)
    resolved = resolve(EngineArgs(model=str(tmp_path), skip_tokenizer=True, device="cpu"))
    assert resolved.scheduler.max_loras == 0 and resolved.worker.enable_lora is False


@pytest.mark.parametrize(
    "settings, block_size",
    [({"device": "cpu"}, 64), ({"device": "cuda"}, 16), ({"device": "cpu", "block_size": 16}, 16)],
)
def test_the_block_size_defaults_by_device_unless_set(tmp_path: Path, settings: dict, block_size: int) -> None:
    tiny_llama_config().save_pretrained(tmp_path)
    resolved = resolve(EngineArgs(model=str(tmp_path), skip_tokenizer=True, **settings))
    assert resolved.scheduler.block_size == resolved.worker.block_size == block_size


@pytest.mark.parametrize(
    "settings, scheduled_ahead",
    [
        ({"executor": "mp"}, True),
        ({"executor": "ray"}, True),
        ({"executor": "mp", "async_scheduling": False}, False),
        ({"executor": "uni"}, False),  # nothing to overlap in one process
        ({"executor": "mp", "speculative_method": "ngram"}, False),
        ({"executor": "mp", "pipeline_parallel_size": 2}, False),
    ],
)
def test_async_scheduling_resolves_on_only_where_a_step_can_be_sent_ahead(
    tmp_path: Path, settings: dict, scheduled_ahead: bool
) -> None:
    tiny_llama_config().save_pretrained(tmp_path)
    resolved = resolve(EngineArgs(model=str(tmp_path), skip_tokenizer=True, device="cpu", **settings))
    assert resolved.scheduler.async_scheduling is scheduled_ahead


@pytest.mark.parametrize("implying", [{"lora_modules": ["a=/a"]}, {"enable_lora_runtime_updates": True}])
def test_adapters_to_serve_imply_enable_lora(implying: dict) -> None:
    assert EngineArgs(**implying).lora_enabled


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lora_modules": ["sql"]}, "lora_modules entries are NAME=PATH, got 'sql'"),
        ({"lora_modules": ["sql=/a", "sql=/b"]}, "lora_modules names 'sql' twice"),
        ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be >= max_loras \(4\)"),
        ({"max_lora_rank": 0}, "max_lora_rank must be >= 1"),
    ],
)
def test_lora_settings_that_cannot_work_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**settings)
