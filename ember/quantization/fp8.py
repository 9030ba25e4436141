"""fp8 (W8A8): float8_e4m3fn weights with one scale per output channel, activations quantized per
token as each layer runs, multiplied by torch._scaled_mm (cuBLASLt's fp8 GEMM, row-wise scales).
At decode batch sizes (up to 16 rows, on CUDA) the weight streams through ember.kernels.fp8_gemv
instead: W8A8 on the fp8 tensor cores too, the activations quantized inside the kernel with a
power-of-two scale per row and K tile (no second kernel). Where the kernel before the layer can
write its output quantized (RMSNorm before qkv and gate_up, SiLU-and-mul before down: they ask
``quantized_input_dtype``), the layer gets float8_e4m3fn rows with their per-token scales and
skips its own quantization at every batch size; up to 16 rows SiLU-and-mul writes one scale per
row and ACTIVATION_GROUP columns instead (``quantized_input_group``), so many programs quantize
a row at once and fp8_gemv applies each scale to its K tiles.

Two ways in:
- fp8 checkpoints: compressed-tensors' "float-quantized" format (quant_method
  "compressed-tensors", weights with strategy "channel" or "tensor") and vLLM's / AutoFP8's
  (quant_method "fp8"): ``weight`` float8_e4m3fn [out, in] and ``weight_scale`` ([out, 1], [1]
  or a scalar). A per-tensor scale is spread over its shard's channels, so fused q/k/v with
  three scales become one per-channel layer. Static-scheme checkpoints also carry
  ``input_scale``; it is loaded and not used: activations always get dynamic per-token scales
  (at least as fine as one static scale). Layers the checkpoint lists in ``ignore`` /
  ``ignored_layers`` / ``modules_to_not_convert`` stay in float.
- ``LLM(quantization="fp8")`` on a float checkpoint: each weight is quantized per channel once
  loaded (max |w| of the channel / 448).

Needs a GPU with fp8 tensor cores (compute capability 8.9+: Ada, Hopper); the CPU and older GPUs
are refused by name, as are block-wise scales (``weight_block_size``, "block"/"group"
strategies), calibrated KV-cache scales (``kv_cache_scheme``) and non-fp8 compressed-tensors
schemes.
"""

from __future__ import annotations

import os
import re
from typing import Any, ClassVar

import torch
from torch import nn

from ember.kernels import dispatch
from ember.kernels.config import kernel_config
from ember.kernels.tuning import SMALL_BATCH_LINEAR_MAX_ROWS
from ember.layers.linear import (
    Linear,
    LinearMethod,
    QuantizedActivation,
    param_owner,
    shard_offset_size,
    tp_slice,
)
from ember.quantization.base import QuantizationMethod
from ember.quantization.checkpoint_config import module_skipped, quantization_config_dict
from ember.quantization.int4_linear import replace_weight

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Columns per activation scale that fp8_gemv takes from a producer (a multiple of its K tiles).
ACTIVATION_GROUP = 1024
# Up to this many rows (decoding one or two sequences) the weights are worth reading into L2
# ahead of their layer (KernelConfig.l2_prefetch).
PREFETCH_ROWS = 2


def _load_weight_scale(param: torch.Tensor, loaded: torch.Tensor,
                       shard_id: int | None = None) -> None:  # fmt: skip
    """A shard's scale into its channels of the layer's per-channel ``weight_scale`` [out]: one
    value (per-tensor) fills them, a vector ([out] or [out, 1]) is copied."""
    layer, name = param_owner(param)
    if layer is None:
        offset, size = 0, param.shape[0]
    else:
        offset, size = shard_offset_size(layer, shard_id)
    dst = param.data.narrow(0, offset, size)
    loaded = loaded.float().reshape(-1)
    if loaded.numel() == 1:
        dst.copy_(loaded.to(dst.device).expand(size))
        return
    if layer is not None:
        loaded = tp_slice(layer, param, loaded)
    if loaded.numel() != size:
        raise ValueError(f"weight {name!r} has {loaded.numel()} scales, the model expects "
                         f"{size} (one per output channel) or 1")
    dst.copy_(loaded)


def _load_input_scale(param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:  # fmt: skip
    """A static-scheme shard's activation scale (kept for the record, see the docstring)."""
    _, name = param_owner(param)
    if loaded.numel() != 1:
        raise ValueError(f"weight {name!r}: a per-tensor input scale has one value, got "
                         f"{loaded.numel()}")
    param.data[shard_id or 0] = loaded.float().reshape(())


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [out, in] -> (float8_e4m3fn [out, in], float32 scales [out])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def per_token_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ember.kernels.fp8_quant.per_token_fp8 computes, in torch ops."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def power_of_two_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1]): each row's scale the smallest
    power of two with max |x| / scale <= 448, as ember.kernels.fp8_gemv quantizes a tile row."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    bits = amax.view(torch.int32)
    exp = ((bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).int()).clamp(min=1)
    scale, inv = (exp << 23).view(torch.float32), ((254 - exp) << 23).view(torch.float32)
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ember.kernels.fp8_gemv computes, in torch ops (float64 sums): x quantized per row and
    ``block_k`` columns (power_of_two_fp8), times the fp8 weight, scaled."""
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float64, device=x.device)
    for start in range(0, x.shape[1], block_k):
        xq, x_scale = power_of_two_fp8(x[:, start:start + block_k])
        out += (xq.double() @ weight[:, start:start + block_k].double().T) * x_scale.double()
    out *= weight_scale.double()
    return out if bias is None else out + bias.double()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, small_batch_rows: int = 0) -> torch.Tensor:  # fmt: skip
    """x [..., in] (16-bit) times an fp8 weight [out, in] with per-channel scales [out]: W8A8
    through torch._scaled_mm (per-token activation scales), or up to ``small_batch_rows`` rows
    on CUDA through the weight-streaming kernel ember.kernels.fp8_gemv (W8A8 with a power-of-two
    scale per row and K tile)."""
    from ember import kernels
    from ember.kernels import dispatch

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] <= small_batch_rows and dispatch.takes_kernel(x2):
        y = kernels.fp8_gemv.fp8_gemv(x2, weight, weight_scale, bias)
        return y.view(*shape[:-1], y.shape[-1])
    if torch.compiler.is_compiling() or not (x2.is_cuda or os.environ.get("TRITON_INTERPRET")
                                             == "1"):
        xq, x_scale = per_token_fp8_torch(x2)  # inductor fuses these; no triton launch traced
    else:
        xq, x_scale = kernels.fp8_quant.per_token_fp8(x2)
    y = fp8_linear_quantized(QuantizedActivation(xq, x_scale), weight, weight_scale, bias,
                             x.dtype)
    return y.view(*shape[:-1], y.shape[-1])


def fp8_linear_quantized(x: QuantizedActivation, weight: torch.Tensor,
                         weight_scale: torch.Tensor, bias: torch.Tensor | None,
                         out_dtype: torch.dtype, small_batch_rows: int = 0) -> torch.Tensor:
    """fp8_linear of activations already quantized per token (x.data float8_e4m3fn [rows, in],
    x.scale float32 [rows, 1]; up to ``small_batch_rows`` rows also [rows, in / group]), in
    ``out_dtype``: up to ``small_batch_rows`` rows through ember.kernels.fp8_gemv, else
    cuBLASLt."""
    if x.data.shape[0] <= small_batch_rows:
        from ember.kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(x.data, weight, weight_scale, bias, x_scale=x.scale, out_dtype=out_dtype)
    if x.scale.shape[-1] != 1:
        raise ValueError(f"cuBLASLt takes one activation scale per row, not {x.scale.shape[-1]} "
                         f"({x.data.shape[0]} rows)")
    # Row-wise scaling in cuBLASLt writes bf16; a float16 model casts the result back.
    y = torch._scaled_mm(x.data, weight.t(), scale_a=x.scale,
                         scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16,
                         use_fast_accum=kernel_config().fp8_fast_accumulation)
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    if bias is not None:
        y = y + bias
    return y


class Fp8LinearMethod(LinearMethod):
    """``weight`` fp8 [out, in] + ``weight_scale`` float32 [out] (from a checkpoint, or from the
    float weight once loaded when ``serialized`` is False)."""

    def __init__(self, serialized: bool, static_input: bool = False) -> None:
        self.serialized = serialized
        self.static_input = static_input

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:  # fmt: skip
        out = sum(output_sizes)
        # Decode batches (up to 16 rows) stream the fp8 weight through ember.kernels.fp8_gemv:
        # at Llama-8B's shapes it beat per-token quantization + cuBLASLt at 1 and 16 rows
        # (gate_up 33.9 against 48.8 us at 16).
        layer.small_batch_max_rows = (SMALL_BATCH_LINEAR_MAX_ROWS
                                      if dispatch.layer_kernels_enabled() else 0)
        layer.activation_dtype = dtype
        layer.l2_prefetch = kernel_config().l2_prefetch  # read as the layer is built
        weight_dtype = FP8 if self.serialized else dtype
        layer.register_weight("weight", nn.Parameter(torch.empty(out, input_size,
                                                                 dtype=weight_dtype),
                                                     requires_grad=False),
                              {"output_dim": 0, "input_dim": 1})
        if not self.serialized:
            return
        layer.register_weight("weight_scale", nn.Parameter(torch.ones(out, dtype=torch.float32),
                                                           requires_grad=False),
                              {"output_dim": 0, "weight_loader": _load_weight_scale})
        if self.static_input:
            layer.register_weight("input_scale", nn.Parameter(
                torch.ones(len(output_sizes), dtype=torch.float32), requires_grad=False),
                {"weight_loader": _load_input_scale})

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.serialized:
            return
        q, scale = quantize_weight_per_channel(layer.weight.data)
        replace_weight(layer, "weight", q, {"output_dim": 0, "input_dim": 1})
        layer.register_weight("weight_scale", nn.Parameter(scale, requires_grad=False),
                              {"output_dim": 0, "weight_loader": _load_weight_scale})

    def quantized_input_dtype(self, layer: Linear, x: torch.Tensor) -> torch.dtype | None:
        # Where the producers' kernels run (CUDA, half precision, not traced by torch.compile).
        return FP8 if dispatch.takes_kernel(x) else None

    def quantized_input_group(self, layer: Linear, x: torch.Tensor) -> int:
        # fp8_gemv (up to small_batch_max_rows rows) applies a scale per K tile as it adds the
        # tile's dot; cuBLASLt above takes one scale per row only.
        from ember.kernels.fp8_gemv import fp8_gemv_config

        k = layer.weight.shape[1]
        if x.shape[0] > layer.small_batch_max_rows or k % ACTIVATION_GROUP:
            return 0
        block_k = fp8_gemv_config(layer.weight.shape[0], k, x.device, True).block_k
        return ACTIVATION_GROUP if ACTIVATION_GROUP % block_k == 0 else 0

    def weights_to_prefetch(self, layer: Linear, rows: int) -> list[torch.Tensor]:
        # Decoding one or two sequences, where fp8_gemv's time is its weight read.
        if layer.l2_prefetch and rows <= PREFETCH_ROWS and dispatch.on_gpu(layer.weight):
            return [layer.weight, layer.weight_scale]
        return []

    def apply(self, layer: Linear, x: torch.Tensor | QuantizedActivation,
              bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            return fp8_linear_quantized(x, layer.weight, layer.weight_scale, bias,
                                        layer.activation_dtype, layer.small_batch_max_rows)
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, layer.small_batch_max_rows)

    def dequantize_weight(self, layer: Linear) -> torch.Tensor:
        """float32 W [out, in] the layer computes with (the quantization check's reference)."""
        return layer.weight.float() * layer.weight_scale[:, None]


def _compressed_tensors_scheme(qc: dict[str, Any]) -> tuple[bool, list[str]]:
    """(static input scales, ignored module patterns) of a compressed-tensors fp8 config;
    ValueError naming anything else."""
    if qc.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme (calibrated KV-cache scales) is not "
                         "supported; use kv_cache_dtype='fp8' (per-tensor scale 1.0)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"holds compressed-tensors-quantized weights in the sparse format "
                         f"{sparsity.get('format')!r}; ember reads dense ones")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("holds compressed-tensors-quantized weights without config_groups")
    static = False
    for name, group in groups.items():
        w = group.get("weights") or {}
        kind = (w.get("type"), w.get("num_bits"))
        if kind != ("float", 8):
            raise ValueError(f"holds compressed-tensors-quantized weights of scheme "
                             f"{w.get('type')}{w.get('num_bits')} (group {name!r}); ember reads "
                             "its fp8 schemes only")
        if w.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"holds compressed-tensors-quantized weights with "
                             f"{w.get('strategy')!r} fp8 scales; ember reads per-channel and "
                             "per-tensor ones")
        act = group.get("input_activations") or {}
        if act and (act.get("type"), act.get("num_bits")) != ("float", 8):
            raise ValueError(f"holds compressed-tensors-quantized weights with "
                             f"{act.get('type')}{act.get('num_bits')} activations (group "
                             f"{name!r}); ember computes fp8 activations")
        static = static or (bool(act) and not act.get("dynamic", True))
    return static, list(qc.get("ignore") or [])


class Fp8Quantization(QuantizationMethod):
    name: ClassVar[str] = "fp8"
    platforms: ClassVar[tuple[str, ...]] = ("cuda",)
    dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("fp8", "compressed-tensors")
    quantizes_float: ClassVar[bool] = True

    def __init__(self, serialized: bool = False, static_input: bool = False,
                 ignore: list[str] | None = None) -> None:  # fmt: skip
        self.serialized = serialized
        self.static_input = static_input
        self.ignore = list(ignore or [])

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> Fp8Quantization:
        """From a checkpoint's quantization_config ({}: quantize a float checkpoint at load)."""
        method = str(qc.get("quant_method", "")).lower()
        if not method:
            return cls()
        if method == "compressed-tensors":
            static, ignore = _compressed_tensors_scheme(qc)
            return cls(True, static, ignore)
        if method != "fp8":
            raise ValueError(f"the fp8 method cannot read {method!r} checkpoints")
        if qc.get("weight_block_size"):
            raise ValueError("fp8 with block-wise scales (weight_block_size) is not supported; "
                             "ember reads per-tensor and per-channel scales")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported")
        ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
        return cls(True, scheme == "static", list(ignore))

    @classmethod
    def from_checkpoint(cls, path: str, hf_config: Any) -> Fp8Quantization:
        qc = quantization_config_dict(hf_config)
        try:
            return cls.from_config(qc)
        except ValueError as exc:
            raise ValueError(f"{path!r}: {exc}") from None

    def check_supported(self, device_type: str, dtype: torch.dtype) -> None:
        super().check_supported(device_type, dtype)
        if torch.cuda.get_device_capability() < (8, 9):
            raise ValueError("quantization 'fp8' needs a GPU with fp8 tensor cores (compute "
                             f"capability 8.9+), this one is {torch.cuda.get_device_capability()}")

    def _ignored(self, prefix: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], prefix):
                    return True
            elif module_skipped(prefix, [pattern]):
                return True
        return False

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod | None:
        if self._ignored(prefix):
            return None
        return Fp8LinearMethod(self.serialized, self.static_input)
