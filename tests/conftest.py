import os

import pytest
import torch

# Without a GPU the Triton kernels can only run in Triton's interpreter (numpy on CPU tensors).
# ``@triton.jit`` reads TRITON_INTERPRET when it decorates a kernel, i.e. when a kernel module
# is imported, and pytest imports conftest.py before any test module, so this is early enough
# for every test. setdefault leaves an explicit choice by the caller alone.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where CUDA is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA, and torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
