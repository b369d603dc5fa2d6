"""The C kernels of ``kernels/csrc``: compiled once per machine with the system C compiler,
cached, and called through ctypes.

The library is built for this CPU (``-march=native``) into
``$STRATA_CACHE_DIR/kernels/native-<key>.so`` (``STRATA_CACHE_DIR`` defaults to
``~/.cache/strata``); the key hashes the sources, the flags, the compiler and the CPU, so a
change to any of them builds a new one. It uses OpenMP from the runtime torch has already
loaded, so its threads are torch's threads.
"""

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from strata.kernels import cpu_features

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=gnu11", "-shared", "-fPIC"]
# A GCC -march value to build for instead of this CPU (e.g. x86-64-v3: the AVX2 bodies), to
# measure another x86 family's bodies on a machine that also runs them.
MARCH_VARIABLE = "STRATA_KERNEL_MARCH"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/dtypes.h
CACHE_DTYPE_CODES = DTYPE_CODES | {torch.float8_e4m3fn: 3}  # float8: KV caches only

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "paged_attention": (
        [_ptr, _i64, _i64, _i32, _ptr, _i32, _i64, _i32, _i32, _i32, _ptr, _i64, _ptr, _ptr, _i32, _i32, _i32, _i32]
        + [ctypes.c_float, _ptr, _i32],
        _i32,
    ),
    "chunk_attention": (
        [_ptr, _i64, _i64, _i32, _ptr, _i32, _i64, _i32, _i32, _i32, _ptr, _i64, _i64, _i32, _i32, ctypes.c_float]
        + [_ptr, _i32],
        _i32,
    ),
    "chunk_attention_bf16_body": ([], _i32),
    "chunk_attention_bf16": (
        [_ptr, _i64, _i64, _ptr, _i64, _i32, _i32, _i32, _ptr, _i64, _i64, _i32, _i32, ctypes.c_float, _ptr, _i32],
        _i32,
    ),
    "write_kv_cache": ([_ptr, _i64, _ptr, _i64, _i32, _ptr, _i64, _i32, _i32, _i32, _ptr, _i64, _i32], _i32),
    "copy_blocks": ([_ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64], _i32),
    "rms_norm": ([_ptr, _ptr, _ptr, _ptr, _i64, _i32, _i32, ctypes.c_float, _i32], None),
    "rotary_embedding": ([_ptr, _i64, _i64, _i32, _i32, _i32, _ptr, _ptr, _i32], None),
    "silu_and_mul": ([_ptr, _ptr, _i64, _i32, _i32, _i32], None),
    "convert": ([_ptr, _i32, _ptr, _i32, _i64, _i32], None),
    "argmax_rows": ([_ptr, _i64, _i64, _ptr, _i32], None),
    "small_batch_linear": ([_ptr, _i32, _i64, _i64, _ptr, _i32, _i64, _ptr, _ptr, _i32, _i32], _i32),
    "small_batch_linear_portable": ([_ptr, _i32, _i64, _i64, _ptr, _i32, _i64, _ptr, _ptr, _i32, _i32], _i32),
    "small_batch_linear_body": ([], _i32),
    # Pointers to the structs of kernels/cpu_decoder_layer.py, then the activations.
    "attention_block": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr], _i32),
    "mlp_block": ([_ptr, _ptr, _ptr, _ptr, _ptr], _i32),
    "decoder_stack": ([_ptr, _ptr, _ptr, _i32, _ptr, _ptr, _ptr, _ptr], _i32),
    # A pointer to kernels/gguf_linear.py's QuantizedMatrix struct, then as small_batch_linear.
    "quantized_linear": ([_ptr, _ptr, _i32, _i64, _i64, _ptr, _ptr, _i32, _i32], _i32),
    "quantized_swiglu": ([_ptr, _ptr, _i32, _i64, _i64, _ptr, _ptr, _i32, _i32], _i32),
    "gguf_linear_supports": ([_i32, _i64], _i32),
    "gguf_linear_body": ([], _i32),
    "gguf_interleave": ([_ptr, _i32, _i64, _i64, _ptr], _i32),
    "gguf_dequantize": ([_ptr, _i32, _i64, _i64, _ptr, _i64, _ptr, _i32, _i32], _i32),
    # A pointer to kernels/lora.py's LoraPoolStruct, the tokens, their slots, the outputs.
    "lora_add": ([_ptr, _ptr, _i32, _i64, _ptr, _ptr, _i32, _i32], _i32),
}


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or ``None`` (logged once) when this machine cannot build them:
    no C compiler, or the compiler fails."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC): the CPU path falls back to torch code")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except subprocess.CalledProcessError as error:
        logger.warning("building the C kernels failed, the CPU path falls back to torch code:\n%s", error.stderr)
        return None
    except OSError as error:
        logger.warning("loading the C kernels failed, the CPU path falls back to torch code: %s", error)
        return None
    return declare_signatures(library)


def library_key() -> str | None:
    """What this machine's kernels are built from (the sources, the flags, the compiler and the
    CPU), hashed; None without a C compiler."""
    compiler = _compiler()
    return _build_key(compiler) if compiler else None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def declare_signatures(library: ctypes.CDLL, names: Iterable[str] | None = None) -> ctypes.CDLL:
    """``library`` with the argument and result types of its kernels ``names`` (default: all)
    declared; a build of some sources for another CPU family declares those it has."""
    for name in names or _SIGNATURES:
        argtypes, restype = _SIGNATURES[name]
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    return library


def flags_for(march: str) -> list[str]:
    """``FLAGS`` building for the x86 family ``march`` (a GCC -march value) instead of this CPU."""
    return [f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS]


def _build_flags() -> list[str]:
    return flags_for(os.environ.get(MARCH_VARIABLE) or "native")


def compile_library(compiler: str, flags: list[str], output: Path, sources: list[Path] | None = None) -> None:
    """Compile ``sources`` (default: every source of ``csrc``) with ``flags`` into the shared
    library ``output``; raises ``CalledProcessError`` (with the compiler's messages) when that fails.

    The sources compile side by side, a compiler process per core, then link: the first build is
    most of an engine's first start, and one compiler run over them all used a single core."""
    sources = sources or sorted(SOURCE_DIR.glob("*.c"))
    with tempfile.TemporaryDirectory(prefix="strata-kernels-") as objects_dir:
        objects = [Path(objects_dir) / f"{index}-{source.stem}.o" for index, source in enumerate(sources)]

        def compile_object(source: Path, object_file: Path) -> None:
            command = [compiler, *flags, "-c", "-I", str(SOURCE_DIR), str(source), "-o", str(object_file)]
            subprocess.run(command, check=True, capture_output=True, text=True)

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            compiling = [pool.submit(compile_object, *pair) for pair in zip(sources, objects)]
            for compiled in compiling:
                compiled.result()  # raises the first failure; leaving the pool waits for the rest
        link = [compiler, *flags, *map(str, objects), "-o", str(output), "-lm"]
        subprocess.run(link, check=True, capture_output=True, text=True)


def _build(compiler: str) -> Path:
    target = cache_dir("kernels") / f"native-{_build_key(compiler)}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Concurrent builders (TP ranks) each write their own file; the rename makes one win whole.
    fd, staging = tempfile.mkstemp(prefix=".native-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        compile_library(compiler, _build_flags(), Path(staging))
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return target


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for source in sorted(SOURCE_DIR.iterdir()):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    version = subprocess.run([compiler, "--version"], check=True, capture_output=True, text=True).stdout
    digest.update("\0".join([compiler, version, *_build_flags(), *sorted(cpu_features.cpu_flags())]).encode())
    return digest.hexdigest()[:16]


def cache_dir(kind: str) -> Path:
    """``$STRATA_CACHE_DIR/kind`` (``STRATA_CACHE_DIR`` defaults to ``~/.cache/strata``): where
    this machine keeps what it built or measured once, by kind (kernels, models, plans)."""
    strata_cache = os.environ.get("STRATA_CACHE_DIR")
    return (Path(strata_cache) if strata_cache else Path.home() / ".cache" / "strata") / kind
