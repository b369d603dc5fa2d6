"""Random weights of any config's shapes: seeded by name, the same for every TP layout, finite."""

import torch

from strata.worker.attention import TorchAttentionBackend
from strata.worker.model_loader import dummy_weights, load_model
from strata.worker.parallel_state import TensorParallel

from model_factory import random_prompts, read_as_saved, tiny_llama_config
from worker_helpers import PagedRunner, greedy_decode


def test_every_checkpoint_tensor_is_drawn_the_same_way_twice() -> None:
    config = read_as_saved(tiny_llama_config())
    first = {name: tensor[:] for name, tensor in dummy_weights(config, torch.float32, "cpu")}
    second = {name: tensor[:] for name, tensor in dummy_weights(config, torch.float32, "cpu")}
    assert first.keys() == second.keys() and "model.layers.1.self_attn.k_proj.weight" in first
    for name, tensor in first.items():
        torch.testing.assert_close(tensor, second[name], rtol=0, atol=0)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], first["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(first["model.norm.weight"], torch.ones(config.hidden_size))


def test_a_shard_is_the_slice_of_the_full_tensor() -> None:
    weights = dict(dummy_weights(read_as_saved(tiny_llama_config()), torch.float32, "cpu"))
    full = weights["model.layers.0.mlp.down_proj.weight"][:]
    torch.testing.assert_close(weights["model.layers.0.mlp.down_proj.weight"][:, 64:], full[:, 64:], rtol=0, atol=0)


def test_a_model_from_a_bare_config_decodes_finite_logits(tmp_path) -> None:
    config = tiny_llama_config(num_hidden_layers=4)
    config.save_pretrained(tmp_path)
    model = load_model(tmp_path, torch.float32, TensorParallel(0, 1), TorchAttentionBackend(), "cpu", "dummy")
    _, logits = greedy_decode(PagedRunner(model), random_prompts([6, 11], config.vocab_size), 4)
    assert torch.isfinite(logits).all() and logits.std() > 0
