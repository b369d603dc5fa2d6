"""Linears whose weights are 8 bits with one float32 scale per output row: FP8 (e4m3) and INT8
(``--quantization fp8 | fp8-weight-only | int8``), quantized at load from an unquantized
checkpoint, or read as stored from an FP8 checkpoint in the compressed-tensors layout.

The LM head and the embedding stay in the model dtype; every ``ColumnParallelLinear`` and
``RowParallelLinear`` (q/k/v, o_proj, gate/up, down) holds a ``ScaledWeight`` instead of its
float weight. A column-parallel rank quantizes its own rows, whose scales are those of the full
matrix; a row-parallel rank holds some columns of every row, so the row's absolute maximum is
taken over the whole group and every rank holds the same scales.
"""

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strata.kernels import reference
from strata.worker.devices import FP8_MIN_CAPABILITY
from strata.worker.llama import LlamaForCausalLM
from strata.worker.parallel_state import TensorParallel
from strata.worker.scaled_linear import ScaledWeight
from strata.worker.tp_layers import ColumnParallelLinear, RowParallelLinear, TensorSource

_CHECKPOINT_SCALES = (".weight_scale", ".input_scale")


@dataclass(frozen=True)
class ScaledScheme:
    """How every linear holds and multiplies its weight: ``weight_dtype`` (int8 or
    float8_e4m3fn), ``w8a8`` (the activations quantized to FP8 too, ``torch._scaled_mm``) or
    weight-only (the Triton GEMM converts the weights in registers), and ``from_checkpoint``
    (the checkpoint stores the FP8 weights and their scales; nothing is quantized at load)."""

    weight_dtype: torch.dtype
    w8a8: bool
    from_checkpoint: bool = False

    def describe(self) -> str:
        kind = "FP8" if self.weight_dtype == torch.float8_e4m3fn else "INT8"
        mode = "W8A8 (activations in FP8: per token, or a checkpoint's static scale)" if self.w8a8 else "weight-only"
        source = "as the checkpoint stores them" if self.from_checkpoint else "quantized at load, per-channel scales"
        return f"{kind} {mode}, {source}"


def scaled_scheme(quantization: str, model: Path, device: torch.device | str) -> ScaledScheme | None:
    """The scheme ``--quantization quantization`` gives the model in directory ``model`` on
    ``device``, or None (the linears keep the model dtype, or GGUF blocks).

    An FP8 checkpoint (``checkpoint_is_fp8``) is loaded as stored under ``auto``, ``fp8``
    (W8A8) and ``fp8-weight-only``, and refused under the others. ``fp8`` and
    ``fp8-weight-only`` quantize an unquantized checkpoint at load; ``int8`` quantizes any. FP8
    needs a GPU of compute capability >= 8.9: elsewhere it is a ValueError naming ``int8``.
    """
    from_checkpoint = checkpoint_is_fp8(model)
    if from_checkpoint and quantization not in ("auto", "fp8", "fp8-weight-only"):
        raise ValueError(
            f"--quantization {quantization}: {model} stores FP8 weights (compressed-tensors); "
            "--quantization auto, fp8 or fp8-weight-only loads them as stored"
        )
    if quantization == "int8":
        return ScaledScheme(torch.int8, w8a8=False)
    if not from_checkpoint and quantization not in ("fp8", "fp8-weight-only"):
        return None
    _check_fp8_device(torch.device(device))
    return ScaledScheme(torch.float8_e4m3fn, w8a8=quantization != "fp8-weight-only", from_checkpoint=from_checkpoint)


def _check_fp8_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(
            f"FP8 weights need a GPU of compute capability >= 8.9, and the model runs on {device}; "
            "--quantization int8 holds 8-bit weights anywhere"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"FP8 weights need a GPU of compute capability >= 8.9, and {torch.cuda.get_device_name(device)} "
            f"has {capability[0]}.{capability[1]}; --quantization int8 runs on it"
        )


def checkpoint_is_fp8(model: Path) -> bool:
    """Whether ``model/config.json`` declares FP8 weights in the compressed-tensors layout: a
    ``quantization_config`` with ``quant_method`` ``compressed-tensors`` whose config groups
    quantize weights to 8-bit floats per channel or per tensor (each linear's ``weight`` in
    float8_e4m3fn beside its float32 ``weight_scale`` and, for static activations, its
    ``input_scale``). Other compressed-tensors schemes and block-wise FP8 raise a ValueError."""
    config_file = model / "config.json"
    quantization = json.loads(config_file.read_text()).get("quantization_config") if config_file.is_file() else None
    if not quantization:
        return False
    method = quantization.get("quant_method")
    if method == "fp8":  # transformers' fine-grained FP8: 128 x 128 blocks, each with its own scale
        raise ValueError(f"{model}: block-wise FP8 weights (weight_scale_inv) are not supported; per-channel or per-tensor scales are")
    if method != "compressed-tensors":
        return False
    for name, group in quantization.get("config_groups", {}).items():
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits"), weights.get("strategy")) not in (
            ("float", 8, "channel"), ("float", 8, "tensor"),
        ):
            raise ValueError(
                f"{model}: compressed-tensors group {name!r} quantizes weights as {weights}; only 8-bit "
                "floats per channel or per tensor are supported"
            )
    return True


@dataclass
class CheckpointScales:
    """The ``weight_scale`` and ``input_scale`` tensors of an FP8 checkpoint, by the name of the
    weight they scale (``...q_proj.weight``)."""

    weight_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def divert(self, weights: Iterable[tuple[str, TensorSource]]) -> Iterator[tuple[str, TensorSource]]:
        """The checkpoint's tensors less its scales, which are read (they are small) and kept here."""
        for name, source in weights:
            if name.endswith(_CHECKPOINT_SCALES):
                stem, _, kind = name.rpartition(".")
                table = self.weight_scales if kind == "weight_scale" else self.input_scales
                table[f"{stem}.weight"] = source[:].float()
            else:
                yield name, source


def load_scaled_weights(
    model: LlamaForCausalLM, weights: Iterable[tuple[str, TensorSource]], scheme: ScaledScheme, tp: TensorParallel
) -> None:
    """Load ``weights`` into ``model`` and give its linears 8-bit weights as ``scheme`` says.

    An FP8 checkpoint's weights pass through the model dtype on the way, which holds every
    float8_e4m3fn value exactly, so turning them back into FP8 loses nothing; a linear the
    checkpoint left unquantized (``ignore``: it has no ``weight_scale``) keeps its float weight.
    """
    scales = CheckpointScales()
    model.load_weights(scales.divert(weights) if scheme.from_checkpoint else weights)
    parts_of = _parts_by_module(model)
    for module_name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if scheme.from_checkpoint:
            scaled = _stored_weight(module, parts_of[module_name], scales, scheme.w8a8)
        else:
            scaled = _quantized_weight(module, scheme, tp)
        if scaled is not None:
            module.scaled, module.weight = scaled, None


def _parts_by_module(model: LlamaForCausalLM) -> dict[str, list[str]]:
    """Each linear's checkpoint weight names, in part order (q, k, v for a merged qkv_proj)."""
    parts: dict[str, list[tuple[int, str]]] = {}
    for name, (key, part) in model._checkpoint_targets().items():
        module_name, _, param_name = key.rpartition(".")
        if param_name == "weight":
            parts.setdefault(module_name, []).append((part or 0, name))
    return {module: [name for _, name in sorted(names)] for module, names in parts.items()}


def _quantized_weight(
    module: ColumnParallelLinear | RowParallelLinear, scheme: ScaledScheme, tp: TensorParallel
) -> ScaledWeight:
    weight = module.weight.data
    amax = weight.abs().amax(dim=1).float()
    if isinstance(module, RowParallelLinear):
        amax = tp.all_reduce_max(amax)
    scale = reference.channel_scales(amax, scheme.weight_dtype)
    return ScaledWeight(reference.quantize_rows(weight, scale, scheme.weight_dtype), scale, scheme.w8a8)


def _stored_weight(
    module: ColumnParallelLinear | RowParallelLinear, names: list[str], scales: CheckpointScales, w8a8: bool
) -> ScaledWeight | None:
    """The FP8 weight a checkpoint stores for ``module`` (its parts ``names``), or None where the
    checkpoint has no ``weight_scale`` for it. Per-tensor scales become per-row ones (the same
    value on every row of the part); a merged layer's parts multiply one activation, so it takes
    the largest of their static input scales."""
    present = [name in scales.weight_scales for name in names]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"checkpoint has weight_scale for only some of {', '.join(names)}")
    rows = module.shards if isinstance(module, ColumnParallelLinear) else [slice(0, module.weight.shape[0])]
    full_rows = module.matrix_rows if isinstance(module, ColumnParallelLinear) else [module.weight.shape[0]]
    scale = torch.cat([
        _row_scales(scales.weight_scales[name], total)[shard] for name, shard, total in zip(names, rows, full_rows)
    ]).to(module.weight.device)
    input_scales = [scales.input_scales[name].reshape(()) for name in names if name in scales.input_scales]
    input_scale = torch.stack(input_scales).max().to(module.weight.device) if input_scales and w8a8 else None
    return ScaledWeight(module.weight.data.to(torch.float8_e4m3fn), scale, w8a8, input_scale)


def _row_scales(weight_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's ``weight_scale`` (``[rows, 1]`` per channel, one value per tensor) as
    ``[rows]`` float32."""
    scale = weight_scale.flatten()
    if scale.numel() == 1:
        return scale.expand(rows)
    if scale.numel() != rows:
        raise ValueError(f"weight_scale has {scale.numel()} values for a weight of {rows} rows")
    return scale
