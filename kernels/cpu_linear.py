"""``x W^T + b`` for the few rows of a decode step on the CPU, from bfloat16 or float32 weights
(``csrc/small_batch_linear.c``), tested against ``F.linear`` in float32.

The library has a portable body (float32 FMAs) and, where the CPU has AVX512-BF16, a body of
bfloat16 dot-product instructions that bfloat16 rows on bfloat16 weights take (``body``)."""

import torch

from strata.kernels import native

# The kernel streams the weights rather than blocking for compute: past a few dozen rows the
# float32 GEMM catches up (AVX2 EPYC, 2 cores, the default model's 30 layers: 97 vs 141 ms at 32
# rows, 166 vs 170 ms at 48).
MAX_ROWS = 32
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``small_batch_linear`` takes these: at most ``MAX_ROWS`` contiguous rows on the CPU
    and a weight ``supports_weight`` takes."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.is_contiguous()
        and x.dtype in native.DTYPE_CODES
        and supports_weight(weight)
    )


def supports_weight(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be streamed: a contiguous bfloat16 or float32 CPU matrix whose input
    size is a multiple of 16, on a machine where the C kernels built."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in WEIGHT_DTYPES
        and weight.is_contiguous()
        and weight.shape[1] % 16 == 0
        and native.load_library() is not None
    )


def body() -> str:
    """Which body bfloat16 rows take on this CPU (for the log)."""
    library = native.load_library()
    if library is not None and library.small_batch_linear_body() == 1:
        return "AVX512-BF16 dot products"
    return "float32 FMAs"


def small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    portable: bool = False,
) -> torch.Tensor:
    """``x W^T + b`` accumulated in float32, rounded once to ``out_dtype`` (default ``x``'s), for
    ``x`` ``[rows, in]`` and a bfloat16 or float32 ``weight`` ``[out, in]`` that ``supports`` accepts.
    ``portable`` runs the portable body whatever the CPU has (the tests check every body)."""
    if not supports(x, weight):
        raise ValueError(
            f"small_batch_linear needs at most {MAX_ROWS} contiguous rows and a contiguous bfloat16 or float32 weight "
            f"with an input size a multiple of 16; got x {list(x.shape)} {x.dtype}, weight {list(weight.shape)} {weight.dtype}"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features, the weight {weight.shape[1]}")
    out_dtype = out_dtype or x.dtype
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
    library = native.load_library()
    kernel = library.small_batch_linear_portable if portable else library.small_batch_linear
    status = kernel(
        x.data_ptr(), native.DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], weight.data_ptr(),
        native.DTYPE_CODES[weight.dtype], weight.shape[0],
        bias.data_ptr() if bias is not None else None, out.data_ptr(), native.DTYPE_CODES[out_dtype],
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("small_batch_linear could not allocate its float32 copy of x")
    return out
