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
    march: str, needed_flags: set[str], sources: list[str], functions: list[str], tmp_path_factory
) -> ctypes.CDLL:
    """``sources`` (files of ``kernels/csrc``) built for GCC's ``-march=march`` once per test
    process, with the ctypes signatures of ``functions``; skips the test where this machine has
    no C compiler, is not x86-64 or lacks one of ``needed_flags`` to run the build."""
    if shutil.which("cc") is None or platform.machine() != "x86_64":
        pytest.skip("needs a C compiler on x86-64")
    missing = needed_flags - cpu_features.cpu_flags()
    if missing:
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))} to run the {march} build")
    return _built(march, tuple(sources), tuple(functions), tmp_path_factory.getbasetemp())


@functools.cache
def _built(march: str, sources: tuple[str, ...], functions: tuple[str, ...], directory: Path) -> ctypes.CDLL:
    output = directory / f"{'+'.join(Path(source).stem for source in sources)}-{march}.so"
    native.compile_library("cc", native.flags_for(march), output, [native.SOURCE_DIR / source for source in sources])
    return native.declare_signatures(ctypes.CDLL(str(output)), list(functions))


@contextlib.contextmanager
def in_place_of_own_build(library: ctypes.CDLL) -> Iterator[None]:
    """The engine's kernels load ``library`` instead of this CPU's own build while inside."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "load_library", lambda: library)
        yield
