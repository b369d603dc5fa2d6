"""A GGUF file's quantized tensors as the checkpoint tensors the model loads, still in blocks.

The converted HF directory (``model_loader``) holds every weight dequantized; with quantized
weights the model takes, instead, the file's own blocks for each tensor stored in a block type
(``GgufTensor``): its linears multiply them as stored (``kernels.gguf_linear``) and its
embedding dequantizes only the rows a step looks up. The tensors stored as floats (norms) still
come from the converted directory.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from strata.kernels import gguf_linear
from strata.worker.gguf_index import TensorEntry, read_index
from strata.worker.model_config import ModelConfig

logger = logging.getLogger(__name__)

FLOAT_TYPES = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16})


@dataclass(frozen=True)
class GgufTensor:
    """A checkpoint matrix ``[rows, cols]`` (HF orientation: out features by in features) stored
    as blocks of ggml type ``type``: ``data`` is the file's uint8 ``[rows, bytes per row]``
    (memory-mapped), ``row_order`` the file row each HF row is, where the converter reordered
    them (Llama's q and k)."""

    name: str
    type: int
    shape: tuple[int, int]
    data: np.ndarray
    row_order: np.ndarray | None = None

    @property
    def type_name(self) -> str:
        return gguf.GGMLQuantizationType(self.type).name

    def rows(self, index: slice) -> torch.Tensor:
        """The blocks of rows ``index``, a contiguous uint8 copy."""
        file_rows = index if self.row_order is None else self.row_order[index]
        return torch.from_numpy(np.array(self.data[file_rows]))

    def columns(self, index: slice) -> torch.Tensor:
        """The blocks of columns ``index`` of every row: the columns must be whole blocks (a
        row-parallel shard), else a ValueError says which shard and block size."""
        values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.type)]
        start, stop, _ = index.indices(self.shape[1])
        if start % values or stop % values:
            raise ValueError(
                f"{self.type_name} blocks hold {values} values, so columns {start}:{stop} of {self.shape[1]} cannot be "
                "split there: choose a tensor-parallel size that splits the layer at whole blocks, or "
                "--quantization none"
            )
        return self.rows(slice(None))[:, start // values * nbytes : stop // values * nbytes].contiguous()

    def check_shape(self, expected: tuple[int, ...]) -> None:
        if tuple(expected) != self.shape:
            raise ValueError(f"shape {self.shape} does not match the {tuple(expected)} the model's config implies")

    def part(self, index: slice) -> gguf_linear.QuantizedPart:
        return gguf_linear.QuantizedPart(self.rows(index), self.type)


class GgufFile:
    """A GGUF file's tensors under the converted directory's (HF) names."""

    def __init__(self, path: Path, config: ModelConfig) -> None:
        index = read_index(path)
        self.path = path
        self.architecture = index.architecture
        self.config = config
        self.tensors = index.tensors
        self.name_map = gguf.get_tensor_name_map(_architecture_id(self.architecture), config.num_hidden_layers)

    def quantized(self, name: str) -> GgufTensor | None:
        """Checkpoint tensor ``name`` if the file stores it as a matrix of blocks, else None."""
        file_name = self.name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        entry = self.tensors.get(file_name) if file_name else None
        if entry is None or not _is_block_matrix(entry):
            return None
        cols, rows = entry.shape
        values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(entry.type)]
        data = np.memmap(self.path, np.uint8, "r", offset=entry.offset, shape=(rows, cols // values * nbytes))
        return GgufTensor(name, entry.type, (rows, cols), data, _row_order(self.architecture, file_name, rows, self.config))

    def types_without_kernel(self) -> set[str]:
        """The block types of the file's matrices that no kernel of ``kernels.gguf_linear`` takes."""
        return {
            gguf.GGMLQuantizationType(entry.type).name
            for entry in self.tensors.values()
            if _is_block_matrix(entry) and not gguf_linear.supports(entry.type, entry.shape[0])
        }


def _is_block_matrix(entry: TensorEntry) -> bool:
    return entry.type not in FLOAT_TYPES and len(entry.shape) == 2


def _architecture_id(name: str) -> "gguf.MODEL_ARCH":
    for arch, arch_name in gguf.MODEL_ARCH_NAMES.items():
        if arch_name == name:
            return arch
    raise ValueError(f"GGUF architecture {name!r} is unknown to the gguf package")


def _row_order(architecture: str, file_name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """llama.cpp's converter interleaves the two rotary halves of each Llama q and k head
    (``permute`` in its convert_hf_to_gguf.py); the HF row order is undone as transformers does
    when it dequantizes the file, so the blocks land where the converted weights are."""
    if architecture != "llama" or not (".attn_q." in file_name or ".attn_k." in file_name):
        return None
    heads = config.num_attention_heads if ".attn_q." in file_name else config.num_key_value_heads
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
