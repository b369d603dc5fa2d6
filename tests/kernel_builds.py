"""The C kernels built for an instruction set other than this CPU's own and put in place of the
engine's library, so that a test runs every body this CPU can execute, not only its own build."""

import contextlib
import ctypes
import functools
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.kernels import cpu_features, native


def runnable_build(
    march: str, needed_flags: set[str], sources: list[str], functions: list[str], tmp_path_factory,
    defines: tuple[str, ...] = (),
) -> ctypes.CDLL:
    """``sources`` (files of ``kernels/csrc``) built for GCC's ``-march=march`` with the macros
    ``defines`` once per test process, with the ctypes signatures of ``functions``; skips the test
    where this machine has no C compiler, is not x86-64 or lacks one of ``needed_flags`` to run
    the build."""
    if shutil.which("cc") is None or platform.machine() != "x86_64":
        pytest.skip("needs a C compiler on x86-64")
    missing = needed_flags - cpu_features.cpu_flags()
    if missing:
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))} to run the {march} build")
    return _built(march, tuple(sources), tuple(functions), defines, tmp_path_factory.getbasetemp())


def emulated_amx_build(sources: list[str], functions: list[str], tmp_path_factory) -> ctypes.CDLL:
    """``sources`` with their AMX bodies, the tile instructions emulated in C
    (``csrc/amx_emulation.h``), built for AVX512-BF16 (``cooperlake``), so that a CPU without AMX
    checks those bodies too; skips where the CPU cannot run that build."""
    needed = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    return runnable_build("cooperlake", needed, sources, functions, tmp_path_factory, ("STRATA_EMULATE_AMX",))


@functools.cache
def _built(
    march: str, sources: tuple[str, ...], functions: tuple[str, ...], defines: tuple[str, ...], directory: Path
) -> ctypes.CDLL:
    name = "+".join([*(Path(source).stem for source in sources), march, *defines])
    output = directory / f"{name}.so"
    flags = [*native.flags_for(march), *(f"-D{macro}" for macro in defines)]
    native.compile_library("cc", flags, output, [native.SOURCE_DIR / source for source in sources])
    return native.declare_signatures(ctypes.CDLL(str(output)), list(functions))


@contextlib.contextmanager
def in_place_of_own_build(library: ctypes.CDLL) -> Iterator[None]:
    """The engine's kernels load ``library`` instead of this CPU's own build while inside."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "load_library", lambda: library)
        yield
