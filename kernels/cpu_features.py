"""What the CPU at hand computes natively, read from ``/proc/cpuinfo`` (and torch's own CPU
capability): the facts the CPU path chooses its dtypes and kernels by."""

from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")

# The vector extensions the kernels have bodies or GEMMs for, widest first.
ISA_LEVELS = (("AMX", "amx_bf16"), ("AVX512-BF16", "avx512_bf16"), ("AVX512", "avx512f"), ("AVX2", "avx2"))


def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags; empty where ``/proc/cpuinfo`` is unreadable."""
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        return frozenset()
    line = next((line for line in lines if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), where oneDNN's bfloat16
    GEMM is fast; elsewhere it emulates bfloat16 through float32 conversions."""
    capability = torch.backends.cpu.get_cpu_capability()
    return "BF16" in capability or "AMX" in capability or bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def isa_level() -> str:
    """The widest vector extension the CPU has among ``ISA_LEVELS`` (for the logs), or ``baseline``."""
    flags = cpu_flags()
    return next((name for name, flag in ISA_LEVELS if flag in flags), "baseline")
