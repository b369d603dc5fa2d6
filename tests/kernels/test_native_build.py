"""Building and loading the C kernels: cached per machine, and a clean fallback to the torch
code where no compiler can build them."""

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from strata.kernels import cpu_layers, native
from strata.worker.attention import get_attention_backend


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """load_library() builds anew into an empty cache; the session's library comes back after."""
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    native.load_library.cache_clear()
    yield tmp_path
    native.load_library.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_library_is_built_once_into_the_cache(fresh_library):
    assert native.load_library() is not None
    [built] = (fresh_library / "kernels").glob("native-*.so")
    stamp = built.stat().st_mtime_ns
    native.load_library.cache_clear()
    assert native.load_library() is not None
    assert built.stat().st_mtime_ns == stamp, "a cached build was compiled again"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_environment_names_the_family_the_kernels_are_built_and_cached_for(monkeypatch):
    own_key = native._build_key("cc")
    monkeypatch.setenv(native.MARCH_VARIABLE, "x86-64-v3")
    assert "-march=x86-64-v3" in native._build_flags() and "-march=native" not in native._build_flags()
    assert native._build_key("cc") != own_key, "an AVX2 build would be taken for this CPU's own from the cache"


@pytest.mark.parametrize("compiler", ["strata-no-such-compiler", "false"], ids=["missing", "failing"])
def test_without_a_working_compiler_the_cpu_path_runs_torch_code(fresh_library, monkeypatch, caplog, compiler):
    monkeypatch.setenv("CC", compiler)
    with caplog.at_level(logging.WARNING, logger="strata.kernels.native"):
        assert native.load_library() is None
    assert "falls back to torch code" in caplog.text
    assert get_attention_backend(None, torch.device("cpu")).name == "torch"
    assert not cpu_layers.handles(torch.ones(2))
    assert not list((fresh_library / "kernels").glob("native-*.so"))


# A build for each x86 family the kernels have bodies for, whatever CPU runs the tests: the
# bodies this CPU lacks are compiled here, and run where the CPU has them.
TARGETS = {"AVX2": "x86-64-v3", "AVX512": "skylake-avx512", "AVX512-BF16": "cooperlake", "AMX": "sapphirerapids"}


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("march", TARGETS.values(), ids=TARGETS.keys())
def test_the_kernels_compile_for_every_x86_family(march: str, tmp_path: Path) -> None:
    # -O0: whether each family's bodies compile (intrinsics, target attributes) does not depend
    # on optimisation, and an unoptimised build of all of them takes a third of the time.
    flags = ["-O0" if flag == "-O3" else flag for flag in native.flags_for(march)]
    try:
        native.compile_library("cc", flags, tmp_path / "native.so")
    except subprocess.CalledProcessError as error:
        pytest.fail(f"-march={march}:\n{error.stderr}")
    symbols = subprocess.run(["nm", "-D", str(tmp_path / "native.so")], capture_output=True, text=True).stdout
    has_bf16_body = "small_batch_linear_avx512bf16" in symbols
    assert has_bf16_body == (march in ("cooperlake", "sapphirerapids"))
