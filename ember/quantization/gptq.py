"""GPTQ checkpoints (quant_method "gptq", AutoGPTQ / GPTQModel): 4-bit weights with a zero point
and a scale per group of input features.

The checkpoint's ``qweight`` [in/8, out] (8 input rows per int32), ``qzeros`` [groups, out/8],
``scales`` [groups, out] and ``g_idx`` [in] load as they are; once loaded they are repacked
into ember's in-memory form (ember.quantization.int4_common), so AWQ and GPTQ share one set of
kernels (v1's zeros, stored as z - 1, become the zeros). With desc_act (act-order) each input
row's group comes from g_idx; the rows are sorted by group at load and the layer permutes its
input to match. The q/k/v (and gate/up)
shards of a fused projection quantize the same input and so carry the same g_idx; a checkpoint
where they differ is refused.

Read from quantization_config: ``bits`` (4), ``group_size`` (-1: one group), ``desc_act``,
``sym``, ``checkpoint_format`` ("gptq": qzeros hold zero - 1, as AutoGPTQ writes them;
"gptq_v2": the zeros). Refused by name: other bit widths, other checkpoint formats (e.g.
"marlin"), a quantized ``lm_head`` and per-module ``dynamic`` overrides.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ember.layers.linear import Linear, LinearMethod, param_owner
from ember.quantization.base import QuantizationMethod
from ember.quantization.checkpoint_config import first_of, module_skipped, quantization_config_dict
from ember.quantization.int4_common import PACK, Int4Weight, gptq_to_int4
from ember.quantization.int4_linear import Int4LinearMethod, int_param


def _load_g_idx(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """g_idx [in] of one shard into row ``shard_id`` of the layer's [shards, in] parameter. A
    row-parallel rank takes its rows, renumbered from its own first group."""
    layer, name = param_owner(param)
    row = param.data[shard_id or 0]
    if layer is not None and layer.tp_size > 1 and layer.tp_split == "input":
        k = row.shape[0]
        loaded = loaded.narrow(0, layer.tp_rank * k, k)
        loaded = loaded - layer.tp_rank * (k // layer.quant_method._group(layer))
    if tuple(loaded.shape) != tuple(row.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(loaded.shape)}, the model expects "
                         f"{tuple(row.shape)}")
    row.copy_(loaded)


class GPTQLinearMethod(Int4LinearMethod):
    """Creates and loads the GPTQ tensors, then repacks them into ember's form."""

    def __init__(self, group_size: int, zero_offset: int, desc_act: bool = False) -> None:
        super().__init__(group_size)
        self.zero_offset = zero_offset
        self.desc_act = desc_act

    format_name = "GPTQ"
    extra_weight_names = ("g_idx",)

    def qweight_shape(self, input_size: int, output_size: int) -> tuple[int, int]:
        return input_size // PACK, output_size  # 8 input rows per int32

    def checkpoint_attrs(self) -> dict[str, dict[str, Any]]:
        # ember's zeros and scales are GPTQ's; its qweight packs 8 input rows per int32 too,
        # but stored [in/8, out].
        return {**self.packed_attrs(), "qweight": {"output_dim": 1, "input_dim": 0,
                                                   "packed_dim": 0, "packed_factor": PACK}}

    def create_extra_weights(self, layer: Linear, input_size: int,
                             output_sizes: list[int]) -> None:  # fmt: skip
        if self.desc_act and layer.tp_size > 1 and layer.tp_split == "input":
            raise ValueError(f"{layer.prefix}: GPTQ with desc_act cannot be split by input "
                             "features over tensor-parallel ranks")
        layer.register_weight("g_idx", int_param(len(output_sizes), input_size),
                              {"input_dim": 1, "weight_loader": _load_g_idx})

    def to_int4(self, layer: Linear) -> Int4Weight:
        g_idx = layer.g_idx.data
        if not (g_idx == g_idx[:1]).all():
            raise ValueError(f"{layer.prefix}: the shards of this fused projection have "
                             "different g_idx; ember cannot compute them as one layer")
        return gptq_to_int4(layer.qweight.data, layer.qzeros.data, layer.scales.data, g_idx[0],
                            self._group(layer), self.zero_offset, layer.prefix or "layer")


class GPTQQuantization(QuantizationMethod):
    name: ClassVar[str] = "gptq"
    platforms: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("gptq",)
    quantizes_float: ClassVar[bool] = False

    def __init__(self, group_size: int = 128, desc_act: bool = False, sym: bool = True,
                 checkpoint_format: str = "gptq",
                 modules_to_not_convert: list[str] | None = None) -> None:  # fmt: skip
        self.group_size, self.desc_act, self.sym = group_size, desc_act, sym
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> GPTQQuantization:
        bits = first_of(qc, "bits", "w_bit", default=4)
        if bits != 4:
            raise ValueError(f"GPTQ with bits={bits} is not supported (ember reads 4-bit GPTQ)")
        fmt = str(first_of(qc, "checkpoint_format", "format", default="gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (ember reads "
                             "'gptq' and 'gptq_v2')")
        if qc.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head (lm_head=true) is not supported")
        if qc.get("dynamic"):
            raise ValueError("GPTQ with per-module 'dynamic' overrides is not supported")
        group = int(first_of(qc, "group_size", default=128))
        return cls(group, bool(qc.get("desc_act", False)), bool(qc.get("sym", True)), fmt,
                   first_of(qc, "modules_to_not_convert", default=None))

    @classmethod
    def from_checkpoint(cls, path: str, hf_config: Any) -> GPTQQuantization:
        return cls.from_config(quantization_config_dict(hf_config))

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod | None:
        if module_skipped(prefix, self.modules_to_not_convert):
            return None
        return GPTQLinearMethod(self.group_size, self.zero_offset, self.desc_act)
