"""Reading PEFT LoRA directories, and refusing the ones a model cannot run, before any request."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from model_factory import read_as_saved, save_tiny_lora, save_tiny_model, tiny_llama_config, tiny_mixtral_config
from safetensors.torch import load_file, save_file

from strata.worker.lora_files import LORA_MODULES, check_adapter, read_adapter

CONFIG = tiny_llama_config()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_model(CONFIG, tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def adapter_dir(base, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapter")
    save_tiny_lora(base, path, LORA_MODULES, rank=8, seed=1, alpha=16)
    return path


def copy_adapter(source: Path, destination: Path, **config_changes: object) -> Path:
    shutil.copytree(source, destination)
    config_file = destination / "adapter_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | config_changes))
    return destination


def test_reads_rank_scale_and_every_layers_a_and_b(adapter_dir: Path) -> None:
    files = read_adapter(adapter_dir)
    assert (files.rank, files.scale, files.target_modules) == (8, 2.0, frozenset(LORA_MODULES))
    assert set(files.weights) == {(layer, module) for layer in range(CONFIG.num_hidden_layers) for module in LORA_MODULES}
    a_name, b_name = files.weights[(1, "k_proj")]
    assert files.shapes[a_name] == (8, CONFIG.hidden_size)
    assert files.shapes[b_name] == (2 * 16, 8)  # 2 KV heads of 16 dims
    check_adapter(files, read_as_saved(CONFIG), max_lora_rank=8)


def test_rslora_scales_by_the_square_root_of_the_rank(adapter_dir: Path, tmp_path: Path) -> None:
    files = read_adapter(copy_adapter(adapter_dir, tmp_path / "rs", use_rslora=True))
    assert files.scale == pytest.approx(16 / math.sqrt(8))


def test_an_adapter_above_the_maximum_rank_is_refused(adapter_dir: Path) -> None:
    with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
        check_adapter(read_adapter(adapter_dir), read_as_saved(CONFIG), max_lora_rank=4)


def test_an_adapter_of_mlp_modules_is_refused_on_a_mixture_of_experts(adapter_dir: Path) -> None:
    with pytest.raises(ValueError, match="targets down_proj, which mixtral models do not have"):
        check_adapter(read_adapter(adapter_dir), read_as_saved(tiny_mixtral_config()), max_lora_rank=16)


def test_an_adapter_of_another_models_shapes_is_refused(adapter_dir: Path) -> None:
    wider = read_as_saved(tiny_llama_config(hidden_size=128))
    with pytest.raises(ValueError, match=r"down_proj.lora_B.weight has shape \[64, 8\], the model's down_proj needs \[128, 8\]"):
        check_adapter(read_adapter(adapter_dir), wider, max_lora_rank=16)


def test_an_adapter_of_more_layers_than_the_model_is_refused(adapter_dir: Path) -> None:
    with pytest.raises(ValueError, match="adapts layer 1; the model has 1 layers"):
        check_adapter(read_adapter(adapter_dir), read_as_saved(tiny_llama_config(num_hidden_layers=1)), max_lora_rank=16)


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_directory_missing_a_file_is_refused(adapter_dir: Path, tmp_path: Path, missing: str) -> None:
    broken = copy_adapter(adapter_dir, tmp_path / "broken")
    (broken / missing).unlink()
    with pytest.raises(ValueError, match=f"has no {missing}"):
        read_adapter(broken)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"use_dora": True}, "uses DoRA"), ({"bias": "all"}, "trains biases"), ({"peft_type": "IA3"}, "is a IA3 adapter")],
)
def test_peft_options_that_change_the_weights_meaning_are_refused(
    adapter_dir: Path, tmp_path: Path, change: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        read_adapter(copy_adapter(adapter_dir, tmp_path / "other", **change))


def test_an_adapter_of_the_embedding_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    other = copy_adapter(adapter_dir, tmp_path / "embedding")
    tensors = load_file(other / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 97)
    save_file(tensors, other / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="embed_tokens.lora_embedding_A, which is not a LoRA A or B"):
        read_adapter(other)


def test_a_half_without_its_other_half_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    other = copy_adapter(adapter_dir, tmp_path / "half")
    tensors = load_file(other / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
    save_file(tensors, other / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="has lora_A but not both halves for layer 0 up_proj"):
        read_adapter(other)
