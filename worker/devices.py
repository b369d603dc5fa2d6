"""Which device a tensor-parallel rank runs on and which ``torch.distributed`` backend its group
uses: pure functions of the configuration and the number of GPUs the process can see."""

import os

# The first GPUs with FP8 tensor cores (Ada, Hopper) have compute capability 8.9; Triton compiles
# float8 e4m3 for no earlier one.
FP8_MIN_CAPABILITY = (8, 9)


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank`` when all ranks share one machine's visible GPUs (``--executor mp``).

    ``cuda`` puts rank ``r`` on ``cuda:r``; ``cuda:K`` puts it on ``cuda:K+r`` (the ranks take
    consecutive GPUs from ``K``); any other device (``cpu``) is every rank's.
    """
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    first = int(index) if index else 0
    return f"cuda:{first + rank}"


def check_device_visible(device: str, rank: int, tensor_parallel_size: int, num_visible_gpus: int) -> None:
    """Raise a ValueError that says what to change when ``device`` is not among the visible GPUs."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return
    wanted = int(index) if index else 0
    if wanted < num_visible_gpus:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{num_visible_gpus} GPU(s) are visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
    raise ValueError(
        f"rank {rank} of {tensor_parallel_size} needs {device} but {seen}: each tensor-parallel rank needs "
        "its own GPU (lower --tensor-parallel-size, pick another first GPU with --device cuda:K, or "
        "make more GPUs visible)"
    )


def distributed_backend(device: str) -> str:
    """NCCL where the tensors live on CUDA, gloo everywhere else."""
    return "nccl" if device.partition(":")[0] == "cuda" else "gloo"
