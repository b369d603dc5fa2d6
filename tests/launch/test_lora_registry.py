"""The frontend's registry of served LoRA adapters: every load checked against the base model
before a request can name it, a fresh id per load, and refusals that say why."""

import shutil
from pathlib import Path

import pytest

from model_factory import read_as_saved, save_tiny_lora, save_tiny_model, tiny_llama_config
from strata.launch.lora_registry import LoRARegistry, LoRARequest

CONFIG = tiny_llama_config()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = save_tiny_model(CONFIG, tmp_path_factory.mktemp("base"))
    path = tmp_path_factory.mktemp("adapter")
    save_tiny_lora(base, path, ("q_proj", "v_proj"), rank=8, seed=1)
    return path


def registry(max_lora_rank: int = 16, enabled: bool = True) -> LoRARegistry:
    return LoRARegistry(read_as_saved(CONFIG), max_lora_rank, enabled)


def test_a_loaded_adapter_is_served_under_its_name(adapter_dir: Path) -> None:
    loras = registry()
    adapter = loras.load("sql", str(adapter_dir))
    assert loras.get("sql") == adapter and adapter.path == str(adapter_dir.resolve()) and adapter.lora_id >= 1


def test_reloading_a_name_gives_a_new_id(adapter_dir: Path) -> None:
    loras = registry()
    first = loras.load("sql", str(adapter_dir))
    loras.unload("sql")
    assert loras.get("sql") is None
    assert loras.load("sql", str(adapter_dir)).lora_id != first.lora_id


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda loras, path: loras.load("sql", str(path / "missing")), "has no adapter_config.json"),
        (lambda loras, path: registry(max_lora_rank=4).load("sql", str(path)), "rank 8, above --max-lora-rank 4"),
        (lambda loras, path: registry(enabled=False).load("sql", str(path)), "start the engine with --enable-lora"),
        (lambda loras, path: [loras.load("sql", str(path)), loras.load("sql", str(path))], "already loaded"),
    ],
    ids=["missing-files", "rank-too-big", "lora-off", "duplicate-name"],
)
def test_an_adapter_that_cannot_be_served_is_refused_with_the_reason(adapter_dir: Path, make, message: str) -> None:
    loras = registry()
    with pytest.raises(ValueError, match=message):
        make(loras, adapter_dir)


def test_an_adapter_whose_shapes_do_not_fit_the_model_is_refused(adapter_dir: Path) -> None:
    wide = LoRARegistry(read_as_saved(tiny_llama_config(hidden_size=128)), 16, True)
    with pytest.raises(ValueError, match="has shape"):
        wide.load("sql", str(adapter_dir))


def test_unloading_an_unknown_name_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="no LoRA adapter named 'sql'"):
        registry().unload("sql")


def test_an_offline_request_loads_its_adapter_once_and_refuses_another_path(adapter_dir: Path, tmp_path: Path) -> None:
    loras = registry()
    first = loras.for_request(LoRARequest("sql", str(adapter_dir)))
    assert loras.for_request(LoRARequest("sql", str(adapter_dir))) == first
    other = shutil.copytree(adapter_dir, tmp_path / "other")
    with pytest.raises(ValueError, match="is served from"):
        loras.for_request(LoRARequest("sql", str(other)))
