"""Each tensor-parallel rank gets its own GPU, and its group the backend its tensors need."""

import pytest

from strata.worker.devices import check_device_visible, distributed_backend, rank_device


@pytest.mark.parametrize(
    "device,rank,expected",
    [
        ("cuda", 0, "cuda:0"),
        ("cuda", 3, "cuda:3"),
        ("cuda:2", 0, "cuda:2"),
        ("cuda:2", 1, "cuda:3"),
        ("cpu", 1, "cpu"),
    ],
)
def test_ranks_take_consecutive_gpus_from_the_configured_one(device: str, rank: int, expected: str) -> None:
    assert rank_device(device, rank) == expected


def test_a_rank_beyond_the_visible_gpus_is_refused_naming_what_to_change(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match=r"rank 1 of 2 needs cuda:1 but 1 GPU\(s\) are visible \(CUDA_VISIBLE_DEVICES=0\)"):
        check_device_visible("cuda:1", 1, 2, num_visible_gpus=1)


def test_a_machine_without_gpus_refuses_a_cuda_rank() -> None:
    with pytest.raises(ValueError, match="needs cuda:0 but 0 GPU"):
        check_device_visible("cuda:0", 0, 1, num_visible_gpus=0)


def test_visible_gpus_and_cpu_ranks_pass() -> None:
    check_device_visible("cuda:1", 1, 2, num_visible_gpus=2)
    check_device_visible("cpu", 1, 2, num_visible_gpus=0)


@pytest.mark.parametrize("device,backend", [("cuda", "nccl"), ("cuda:1", "nccl"), ("cpu", "gloo")])
def test_nccl_only_for_cuda_tensors(device: str, backend: str) -> None:
    assert distributed_backend(device) == backend
