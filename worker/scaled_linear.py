"""A linear's weight held in 8 bits with one float32 scale per output row, and its multiplication
on each device (FP8 and INT8, ``worker/scaled_weights.py`` says which and loads them)."""

from dataclasses import dataclass

import torch

from strata.kernels import reference, scaled_mm


@dataclass
class ScaledWeight:
    """A linear's weight ``[N, K]`` in 8 bits with one float32 ``scale`` per output row (``weight *
    scale[:, None]`` stands for the float weight); ``input_scale``: a W8A8 checkpoint's static
    activation scale (None: each token's own)."""

    weight: torch.Tensor
    scale: torch.Tensor
    w8a8: bool
    input_scale: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b`` in ``x``'s dtype: FP8 tensor cores for W8A8, else the Triton GEMM on
        CUDA and the dequantized torch computation elsewhere."""
        if self.w8a8:
            return scaled_mm.w8a8_linear(x, self.weight, self.scale, bias, self.input_scale)
        if x.is_cuda:
            # Imported here, as Triton is only needed on CUDA: loading it costs a CPU worker ~0.7 s.
            from strata.kernels import triton_scaled_linear

            return triton_scaled_linear.scaled_linear(x, self.weight, self.scale, bias)
        return reference.scaled_linear(x, self.weight, self.scale, bias)
