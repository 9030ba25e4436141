"""AWQ checkpoints (quant_method "awq", AutoAWQ's "gemm" layout): 4-bit weights with a zero point
and a scale per group of input features, computed without dequantizing them to memory.

The checkpoint's ``qweight`` [in, out/8], ``qzeros`` [in/g, out/8] (int32, AutoAWQ's
interleaved packing) and ``scales`` [in/g, out] load into the layer as they are, fused q/k/v and
gate/up shards included (packed along the output dim, the loader narrows by 8); once loaded,
each layer is repacked into ember's column-major form (ember.quantization.int4_common), which
the one-row GEMV streams a column's packs at a time.

Read from quantization_config: ``bits`` / ``w_bit`` (4), ``group_size`` / ``q_group_size``,
``zero_point`` (true), ``version`` ("gemm"), ``modules_to_not_convert`` (those layers stay in
float). Anything else AWQ can write (other bit widths, the "gemv"/"gemv_fast"/"marlin"/
"exllama" layouts, zero_point false) is refused by name.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ember.layers.linear import Linear, LinearMethod
from ember.quantization.base import QuantizationMethod
from ember.quantization.checkpoint_config import first_of, module_skipped, quantization_config_dict
from ember.quantization.int4_common import PACK, Int4Weight, awq_to_int4
from ember.quantization.int4_linear import Int4LinearMethod


class AWQLinearMethod(Int4LinearMethod):
    """Loads AWQ's tensors, then repacks them into ember's form."""

    format_name = "AWQ"

    def qweight_shape(self, input_size: int, output_size: int) -> tuple[int, int]:
        return input_size, output_size // PACK  # 8 output columns per int32

    def checkpoint_attrs(self) -> dict[str, dict[str, Any]]:
        column_packed = {"output_dim": 1, "input_dim": 0, "packed_dim": 1, "packed_factor": PACK}
        return {"qweight": column_packed, "qzeros": column_packed,
                "scales": {"output_dim": 1, "input_dim": 0}}

    def to_int4(self, layer: Linear) -> Int4Weight:
        return awq_to_int4(layer.qweight.data, layer.qzeros.data, layer.scales.data,
                           self._group(layer))


class AWQQuantization(QuantizationMethod):
    name: ClassVar[str] = "awq"
    platforms: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("awq",)
    quantizes_float: ClassVar[bool] = False

    def __init__(self, group_size: int = 128, modules_to_not_convert: list[str] | None = None,
                 ) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> AWQQuantization:
        bits = first_of(qc, "bits", "w_bit", default=4)
        if bits != 4:
            raise ValueError(f"AWQ with bits={bits} is not supported (ember reads 4-bit AWQ)")
        if first_of(qc, "zero_point", default=True) is not True:
            raise ValueError("AWQ with zero_point=false is not supported (ember reads AWQ with "
                             "zero points)")
        version = str(first_of(qc, "version", default="gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (ember reads the 'gemm' "
                             "layout)")
        group = int(first_of(qc, "group_size", "q_group_size", default=128))
        return cls(group, first_of(qc, "modules_to_not_convert", default=None))

    @classmethod
    def from_checkpoint(cls, path: str, hf_config: Any) -> AWQQuantization:
        return cls.from_config(quantization_config_dict(hf_config))

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod | None:
        if module_skipped(prefix, self.modules_to_not_convert):
            return None
        return AWQLinearMethod(self.group_size)
