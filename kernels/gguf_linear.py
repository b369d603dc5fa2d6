"""``x W^T + b`` on weights kept in the quantized blocks a GGUF file stores them in
(``csrc/gguf_linear.c``: the activations quantized to int16 per run of 32), and
the blocks' dequantization; tested against the ``gguf`` package's numpy dequantization.

A weight is a ``QuantizedMatrix``: up to three row ranges (``QuantizedPart``), each of one block
type, stacked by rows, so a merged q/k/v whose parts a file stores in different types is still one
call.
"""

import ctypes
from dataclasses import dataclass, field

import torch

from strata.kernels import native

# ggml's type codes (ggml.h) of the block formats the kernels read, by the names GGUF tools print.
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
TYPE_NAMES = {code: name for name, code in TYPES.items()}
MAX_PARTS = 3
# csrc/gguf_linear.c's layout of Q4_0, Q4_1 and Q8_0 rows interleaved INTERLEAVED_ROWS at a time,
# which its kernel multiplies 16 rows per instruction in: the type code | INTERLEAVED.
INTERLEAVED, INTERLEAVED_ROWS = 0x100, 16
_INTERLEAVABLE_BLOCK_BYTES = {TYPES["Q4_0"]: 18, TYPES["Q4_1"]: 20, TYPES["Q8_0"]: 34}  # blocks of 32 values

_BODIES = {
    5: "AVX512-BF16 products (vdpbf16ps) from the rows measured faster, AVX512-VNNI int16 dot products otherwise",
    4: "AMX bfloat16 tiles from 16 bfloat16 rows, AVX512-VNNI int16 dot products otherwise",
    2: "AVX512-VNNI int16 dot products",
    3: "AVX-512 int16 dot products (no VNNI)",
    1: "AVX2 int16 dot products",
    0: "portable C",
}
# csrc/gguf_linear.c's status codes.
_NO_MEMORY, _UNSUPPORTED_TYPE, _BAD_SHAPE, _ROW_OUT_OF_RANGE = -1, -2, -3, -4


class MatrixStruct(ctypes.Structure):
    """``struct QuantizedMatrix`` of ``csrc/kernels.h``."""

    _fields_ = [
        ("parts", ctypes.c_int32),
        ("types", ctypes.c_int32 * MAX_PARTS),
        ("rows", ctypes.c_int64 * MAX_PARTS),
        ("data", ctypes.c_void_p * MAX_PARTS),
        ("bfloat16_dot_rows", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class QuantizedPart:
    """Rows of a weight matrix as blocks of ggml type ``type``: ``data`` is uint8
    ``[rows, bytes per row]``, contiguous. An ``interleaved`` part's rows are not separable (its
    ``data`` holds them 16 at a time): a linear multiplies it, ``dequantize`` and ``lookup`` read it."""

    data: torch.Tensor
    type: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def base_type(self) -> int:
        """The file's block type."""
        return self.type & ~INTERLEAVED


def interleaved(part: QuantizedPart) -> QuantizedPart:
    """``part`` in the layout the Q4_0/Q4_1/Q8_0 kernel multiplies 16 rows at a time, where it takes
    it (same bytes, rows interleaved in groups of 16); otherwise ``part`` itself."""
    if part.type not in _INTERLEAVABLE_BLOCK_BYTES or part.rows % INTERLEAVED_ROWS:
        return part
    out = torch.empty_like(part.data)
    in_features = part.data.shape[1] // _INTERLEAVABLE_BLOCK_BYTES[part.type] * 32
    status = native.load_library().gguf_interleave(part.data.data_ptr(), part.type, part.rows, in_features, out.data_ptr())
    _raise_for(status)
    return QuantizedPart(out, part.type | INTERLEAVED)


@dataclass
class QuantizedMatrix:
    """A weight ``[out_features, in_features]`` stored as ``parts`` stacked by rows.

    ``bfloat16_dot_rows``: steps of at least this many bfloat16 rows multiply its interleaved parts
    by AVX512-BF16 products on the blocks dequantized to bfloat16 (0: never), where the CPU has
    that body (``bfloat16_dot_products``); measured at start (``worker/cpu_linear_plan.py``)."""

    parts: list[QuantizedPart]
    in_features: int
    bfloat16_dot_rows: int = 0
    struct: MatrixStruct = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= len(self.parts) <= MAX_PARTS:
            raise ValueError(f"a quantized matrix has 1 to {MAX_PARTS} parts, got {len(self.parts)}")
        for part in self.parts:
            if not supports(part.type, self.in_features):
                name = TYPE_NAMES.get(part.base_type, f"ggml type {part.type}")
                raise ValueError(f"no kernel takes {name} rows of {self.in_features} values")
            if part.data.dtype != torch.uint8 or part.data.dim() != 2 or not part.data.is_contiguous():
                raise ValueError("a quantized part's data must be a contiguous uint8 [rows, bytes per row] tensor")
        self.struct = MatrixStruct(
            len(self.parts),
            (ctypes.c_int32 * MAX_PARTS)(*[part.type for part in self.parts]),
            (ctypes.c_int64 * MAX_PARTS)(*[part.rows for part in self.parts]),
            (ctypes.c_void_p * MAX_PARTS)(*[part.data.data_ptr() for part in self.parts]),
            self.bfloat16_dot_rows,
        )

    def set_bfloat16_dot_rows(self, rows: int) -> None:
        """Steps of at least ``rows`` bfloat16 rows (0: none) multiply by AVX512-BF16 products."""
        self.bfloat16_dot_rows = self.struct.bfloat16_dot_rows = rows

    def rebind(self) -> None:
        """Point ``struct`` at the parts' data where it lies now, after it moved (``Tensor.set_``)."""
        for i, part in enumerate(self.parts):
            self.struct.data[i] = part.data.data_ptr()

    @property
    def out_features(self) -> int:
        return sum(part.rows for part in self.parts)

    def nbytes(self) -> int:
        return sum(part.data.numel() for part in self.parts)


def supports(ggml_type: int, in_features: int) -> bool:
    """Whether a kernel takes rows of ``in_features`` values of ``ggml_type`` blocks: a type of
    ``TYPES`` and whole blocks per row, on a machine where the C kernels built."""
    library = native.load_library()
    return library is not None and bool(library.gguf_linear_supports(ggml_type, in_features))


def body() -> str:
    """Which byte dot product this CPU's build runs (for the log)."""
    return _BODIES[native.load_library().gguf_linear_body()]


def bfloat16_dot_products() -> bool:
    """Whether this CPU's build can multiply interleaved parts by AVX512-BF16 products
    (``QuantizedMatrix.bfloat16_dot_rows``): AVX512-BF16 without AMX tiles granted."""
    return native.load_library().gguf_linear_body() == 5


def linear(
    x: torch.Tensor, matrix: QuantizedMatrix, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x W^T + b`` for ``x`` ``[rows, in_features]`` (float32, bfloat16 or float16) with the
    activations quantized to int16 per run of 32, accumulated in float32 and rounded once to
    ``out_dtype`` (default ``x``'s); ``bias`` float32 or None."""
    _check_rows(x, matrix)
    x = x.contiguous()
    out_dtype = out_dtype or x.dtype
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.empty(x.shape[0], matrix.out_features, dtype=out_dtype)
    status = native.load_library().quantized_linear(
        ctypes.byref(matrix.struct), x.data_ptr(), native.DTYPE_CODES[x.dtype], x.shape[0], x.shape[1],
        None if bias is None else bias.data_ptr(), out.data_ptr(), native.DTYPE_CODES[out_dtype],
        torch.get_num_threads(),
    )
    _raise_for(status)
    return out


def swiglu(x: torch.Tensor, matrix: QuantizedMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``[gate | up] = linear(x, matrix, bias)`` (``matrix`` a merged
    gate/up: the gates' rows, then as many ups'), bit for bit what ``linear`` then
    ``cpu_layers.silu_and_mul`` give, without the gate/up output in between where the kernel
    multiplies on AMX tiles: ``[rows, out_features / 2]`` in ``x``'s dtype."""
    _check_rows(x, matrix)
    if matrix.out_features % 2:
        raise ValueError(f"a gate/up matrix has an even number of rows, got {matrix.out_features}")
    x = x.contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.empty(x.shape[0], matrix.out_features // 2, dtype=x.dtype)
    status = native.load_library().quantized_swiglu(
        ctypes.byref(matrix.struct), x.data_ptr(), native.DTYPE_CODES[x.dtype], x.shape[0], x.shape[1],
        None if bias is None else bias.data_ptr(), out.data_ptr(), native.DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    _raise_for(status)
    return out


def dequantize(matrix: QuantizedMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[out_features, in_features]`` in ``dtype``: ggml's float32 values, rounded."""
    out = torch.empty(matrix.out_features, matrix.in_features, dtype=dtype)
    start = 0
    for part in matrix.parts:
        dequantize_rows(part, matrix.in_features, out[start : start + part.rows])
        start += part.rows
    return out


def dequantize_rows(part: QuantizedPart, in_features: int, out: torch.Tensor) -> None:
    """Write the float values of ``part``'s rows into the contiguous ``out`` ``[rows, in_features]``."""
    if out.shape != (part.rows, in_features) or not out.is_contiguous() or out.dtype not in native.DTYPE_CODES:
        raise ValueError(f"dequantize_rows needs a contiguous [{part.rows}, {in_features}] float output")
    status = native.load_library().gguf_dequantize(
        part.data.data_ptr(), part.type, part.rows, in_features, None, part.rows, out.data_ptr(),
        native.DTYPE_CODES[out.dtype], torch.get_num_threads(),
    )
    _raise_for(status)


def lookup(part: QuantizedPart, in_features: int, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float values of ``part``'s rows ``ids`` (int64, any shape; each in ``[0, rows)``),
    ``[*ids.shape, in_features]`` in ``dtype``: an embedding lookup on blocks, either layout."""
    one_dim = ids.dim() == 1 and ids.dtype == torch.int64 and ids.is_contiguous()  # a step's token ids
    flat = ids if one_dim else ids.reshape(-1).to(torch.int64).contiguous()
    if dtype not in native.DTYPE_CODES:
        raise ValueError(f"lookup needs a float dtype of {', '.join(map(str, native.DTYPE_CODES))}, got {dtype}")
    out = torch.empty(flat.numel(), in_features, dtype=dtype)
    status = native.load_library().gguf_dequantize(
        part.data.data_ptr(), part.type, flat.numel(), in_features, flat.data_ptr(), part.rows, out.data_ptr(),
        native.DTYPE_CODES[dtype], torch.get_num_threads(),
    )
    if status == _ROW_OUT_OF_RANGE:
        raise IndexError(f"row ids must lie in [0, {part.rows})")
    _raise_for(status)
    return out if one_dim else out.view(*ids.shape, in_features)


def _check_rows(x: torch.Tensor, matrix: QuantizedMatrix) -> None:
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != matrix.in_features or x.dtype not in native.DTYPE_CODES:
        raise ValueError(
            f"quantized linear needs CPU rows of {matrix.in_features} features in "
            f"{', '.join(map(str, native.DTYPE_CODES))}; got {list(x.shape)} {x.dtype} on {x.device}"
        )


def _raise_for(status: int) -> None:
    if status == _NO_MEMORY:
        raise MemoryError("the quantized linear could not allocate its working copy (activations or gate/up outputs)")
    if status in (_UNSUPPORTED_TYPE, _BAD_SHAPE):
        raise ValueError("no kernel takes this block type and row length")  # QuantizedMatrix checks first
