"""The GPU proof's preflight: what this host offers the proof, one ``name: value`` line each.

    python benchmarks/gpu_preflight.py

Python, torch, CUDA and Triton versions; the C compiler and ``Python.h`` that Triton needs to
build its kernel launcher; one tiny Triton kernel compiled and run on the GPU. Imports nothing of
strata, which is not installed yet when it runs. A check that fails prints why and the others
still run; the exit status is 1 if any failed.
"""

import os
import platform
import shutil
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path


def python_version() -> str:
    return f"{platform.python_version()} at {sys.executable}"


def torch_version() -> str:
    import torch

    return f"{torch.__version__} (CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()})"


def gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    major, minor = torch.cuda.get_device_capability()
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()} (sm_{major}{minor}, {total_gib:.0f} GiB)"


def triton_version() -> str:
    import triton

    return triton.__version__


def c_compiler() -> str:
    """The compiler Triton builds its launcher with: $CC, else the first of clang, gcc, cc on PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["clang", "gcc", "cc"]
    found = next((path for name in candidates if (path := shutil.which(name))), None)
    if found is None:
        raise RuntimeError(f"none of {', '.join(candidates)} on PATH")
    return found


def python_header() -> str:
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        raise RuntimeError(f"{header} is missing (install the Python development headers)")
    return str(header)


def triton_kernel() -> str:
    """Compile and run one elementwise kernel on the GPU: Triton, its launcher build and the driver."""
    import torch
    import triton
    import triton.language as tl

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device to run it on")

    @triton.jit
    def add_one(source, target, count, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < count
        tl.store(target + offsets, tl.load(source + offsets, mask=mask) + 1, mask=mask)

    source = torch.arange(1000, dtype=torch.float32, device="cuda")
    target = torch.empty_like(source)
    add_one[(triton.cdiv(1000, 256),)](source, target, 1000, BLOCK=256)
    if not torch.equal(target, source + 1):
        raise RuntimeError("the kernel ran but computed wrong values")
    return "compiled and ran, values correct"


CHECKS: dict[str, Callable[[], str]] = {
    "python": python_version,
    "torch": torch_version,
    "gpu": gpu,
    "triton": triton_version,
    "c compiler": c_compiler,
    "Python.h": python_header,
    "triton kernel": triton_kernel,
}


def main() -> int:
    failed = 0
    for name, check in CHECKS.items():
        try:
            value = check()
        except Exception as error:
            value = f"FAILED: {type(error).__name__}: {error}"
            failed += 1
        print(f"{name}: {value}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
