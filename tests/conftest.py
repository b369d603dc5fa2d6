import os

import torch

# Without a GPU the Triton kernels can only run in Triton's interpreter (numpy on CPU tensors).
# ``@triton.jit`` reads TRITON_INTERPRET when it decorates a kernel, i.e. when a kernel module
# is imported, and pytest imports conftest.py before any test module, so this is early enough
# for every test. setdefault leaves an explicit choice by the caller alone.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
