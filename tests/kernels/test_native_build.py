"""Building and loading the C kernels: cached per machine, and a clean fallback to the torch
code where no compiler can build them."""

import logging
import shutil

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


@pytest.mark.parametrize("compiler", ["strata-no-such-compiler", "false"], ids=["missing", "failing"])
def test_without_a_working_compiler_the_cpu_path_runs_torch_code(fresh_library, monkeypatch, caplog, compiler):
    monkeypatch.setenv("CC", compiler)
    with caplog.at_level(logging.WARNING, logger="strata.kernels.native"):
        assert native.load_library() is None
    assert "falls back to torch code" in caplog.text
    assert get_attention_backend(None, torch.device("cpu")).name == "torch"
    assert not cpu_layers.handles(torch.ones(2))
    assert not list((fresh_library / "kernels").glob("native-*.so"))
