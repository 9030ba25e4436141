"""The ``gguf`` quantization method: a GGUF file's linear weights stay quantized in memory and
are computed on directly (selected by the checkpoint itself: every .gguf file).

Loading: the GGUF loader yields each quantized linear weight as its raw blocks
(ember.models.loader.gguf.keep_quantized); this method's weight loader keeps them per shard of
the fused projection (q/k/v, gate/up), whose types may differ. After loading, consecutive shards
of one kind are joined and each part gets its compute form:

- on a CPU with AVX512-BF16, every type with groups of 32 (Q4_0, Q4_1, Q4_K in 4 bits; Q5_0,
  Q5_1, Q8_0, Q5_K in 8): ember's native kernel (ember.kernels.cpu.quant_linear, built on first
  use), which reuses each weight across a batch's rows (1.6-2.0x torch's int4 matmul at 32-128
  rows, and faster at one row too).
- elsewhere, 4-bit codes on the CPU: torch's int4 weight-only matmul
  (``_weight_int4pack_mm_for_cpu``, group 32, bfloat16 activations: it has no fast float32
  path), with ``scale_and_zero`` = (scale, min + 8 * scale) so that (q - 8) * s + z = s * q + min.
  Both give each row the same result whatever the batch.
- every supported type on CUDA (and on the CPU in its tests, interpreted): the Triton
  dequantize-matmul ember.kernels.gguf_matmul on the affine codes.
- other types on the CPU (Q6_K; without the native kernel Q5_0, Q5_1, Q8_0, Q5_K too): the
  codes are dequantized per call
  into the activation dtype and multiplied by F.linear (memory stays quantized, time does not
  improve on a float layer).
- F32/F16/BF16 tensors (some GGUFs keep a few layers in float): a float weight.

The embedding, norms and logits head are loaded in float (dequantized); on the CPU the head
computes in 8 bits (``process_model_after_loading``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels.cpu import quant_linear as native
from ember.layers.linear import Linear, LinearMethod, shard_offset_size
from ember.quantization.base import QuantizationMethod
from ember.quantization.gguf_blocks import (
    FLOAT_TYPES,
    SUPPORTED,
    AffineCodes,
    decode_blocks,
)

_INT4_CPU_DTYPE = torch.bfloat16
# Every row count goes through torch's int4 matmul, prefill too, though a dense bfloat16 matmul
# of the dequantized weight is ~3x faster there: the int4 matmul gives each row the same result
# whatever the batch, and the dense one does not (bfloat16 F.linear differs below 16-32 rows), so
# a token computed in a large prefill and again in a small recompute (preemption, prefix caching)
# would differ, and greedy outputs would depend on how requests were batched.


class GGUFQuantization(QuantizationMethod):
    name = "gguf"
    checkpoint_formats = ("gguf",)
    quantizes_float = False
    skip_modules = ()

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod:
        return GGUFLinearMethod()

    def process_model_after_loading(self, model: nn.Module) -> None:
        """On the CPU, the logits head (the tied embedding, or lm_head) gets an 8-bit copy for
        ``compute_logits``: Q8_0's codes (a scale per 32 inputs) for ember's native kernel, else
        int8 with one scale per row for torch's: at 135M parameters its float32 matmul is the
        largest of a decode step (49152 x 576). The embedding keeps its float rows for lookup."""
        tied = bool(getattr(model, "tie_word_embeddings", False))
        suffix = "embed_tokens" if tied else "lm_head"
        for name, head in model.named_modules():
            weight = getattr(head, "weight", None)
            if (name.endswith(suffix) and isinstance(weight, torch.Tensor) and weight.dim() == 2
                    and weight.device.type == "cpu"):
                native_head = NativeLogits.build(weight.detach()) if _native_kernel() else None
                head.logits_method = native_head or Int8Logits(weight.detach())
                return

    def loading_context(self):  # type: ignore[no-untyped-def]
        from ember.models.loader.gguf import keep_quantized

        return keep_quantized()

    def snapshot_variant(self, device: torch.device) -> str:
        """The CPU's compute form: the native kernel's blocks (in their layout), or torch's int4
        packing."""
        return f"native-{native.LAYOUT}" if device.type == "cpu" and _native_kernel() else ""

    def snapshot_recipe(self, model: nn.Module) -> dict[str, Any] | None:
        """On the CPU, where decoding the blocks and packing the 4-bit layers is most of a small
        model's load: each layer's parts (rows, kind, meta, buffer names) and the 8-bit head's
        module, kind and rows."""
        layers: dict[str, list[list[Any]]] = {}
        logits = logits_kind = logits_rows = None
        for name, module in model.named_modules():
            parts = getattr(module, "gguf_parts", None)
            if parts is not None:
                if any(p.kind == "triton" for p in parts):
                    return None  # the GPU's form: quick to build, and device memory
                layers[name] = [[p.rows, p.kind, p.meta, [n for n, _ in p.named_buffers()]]
                                for p in parts]
            head = getattr(module, "logits_method", None)
            if isinstance(head, (Int8Logits, NativeLogits)):
                logits, logits_kind = name, head.kind
                logits_rows = getattr(head, "vocab", None)
        return {"layers": layers, "logits": logits, "logits_kind": logits_kind,
                "logits_rows": logits_rows}

    def restore_snapshot(self, model: nn.Module, recipe: dict[str, Any],
                         tensors: dict[str, torch.Tensor]) -> None:
        if _use_triton(next(model.parameters()).device):
            raise ValueError("this load takes the Triton kernels: the snapshot's CPU forms "
                             "do not apply")
        if (recipe["logits_kind"] == "native" or any(
                kind == "native" for parts in recipe["layers"].values() for _, kind, _, _ in parts)
                ) and not _native_kernel():
            raise ValueError("the snapshot needs the native quantized CPU kernel, which cannot "
                             "be built here")
        modules = dict(model.named_modules())
        for name, parts in recipe["layers"].items():
            layer = modules[name]
            layer.gguf_parts = nn.ModuleList(
                _Part(rows, kind, {n: tensors[f"{name}.gguf_parts.{i}.{n}"] for n in names}, meta)
                for i, (rows, kind, meta, names) in enumerate(parts))
            layer._gguf_forwards = [p.forward for p in layer.gguf_parts]
            layer._gguf_shards = {}
        if recipe["logits"] is not None:
            prefix = f"{recipe['logits']}.logits_method."
            head = (NativeLogits.from_blocks(tensors[prefix + "blocks"], recipe["logits_rows"])
                    if recipe["logits_kind"] == "native"
                    else Int8Logits.from_quantized(tensors[prefix + "qweight"],
                                                   tensors[prefix + "scale"]))
            modules[recipe["logits"]].logits_method = head


# The kernel on the CPU under TRITON_INTERPRET=1 is for its own tests, which set this too: the
# variable alone does not switch, because a test session sets it for other kernels' tests and
# every default-model engine (and its spawned processes) would then run interpreted kernels.
INTERPRET_ON_CPU = False


def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or (INTERPRET_ON_CPU
                                     and os.environ.get("TRITON_INTERPRET") == "1")


class NativeLogits(nn.Module):
    """hidden @ W^T from W in 8-bit codes with a float16 scale per 32 inputs (Q8_0's rounding:
    a Q8_0 embedding keeps its own codes), on ember's native kernel, in float32."""

    kind = "native"
    vocab: int  # the head's rows

    @classmethod
    def build(cls, weight: torch.Tensor) -> NativeLogits | None:
        blocks = native.pack_symmetric_8bit(weight)
        return None if blocks is None else cls.from_blocks(blocks, weight.shape[0])

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, rows: int) -> NativeLogits:
        head = cls()
        head.register_buffer("blocks", blocks)
        head.vocab = rows  # a plain int: traced code reads it as a constant
        return head

    def prepare_for_compile(self) -> None:
        native.quant_linear_op()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return native.linear(hidden, self.blocks, self.vocab, 8)


class Int8Logits(nn.Module):
    """hidden @ W^T from W rounded to int8 with one float scale per row (torch's int8
    weight-only matmul, bfloat16 activations), returned in float32."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127)
                             .to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(torch.bfloat16))

    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, scale: torch.Tensor) -> Int8Logits:
        """The head as ``__init__`` made it, from its saved buffers."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.register_buffer("qweight", qweight)
        head.register_buffer("scale", scale)
        return head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale)
        return y.float().view(*hidden.shape[:-1], -1)


class _Part(nn.Module):
    """A run of output rows of one compute form; its tensors are buffers (weights, not
    trainable parameters), so moving and sleeping the model moves them."""

    def __init__(self, rows: int, kind: str, tensors: dict[str, torch.Tensor],
                 meta: dict[str, Any]) -> None:  # fmt: skip
        super().__init__()
        self.rows, self.kind, self.meta = rows, kind, meta
        for name, t in tensors.items():
            self.register_buffer(name, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "native":
            y = native.linear(x, self.blocks, self.rows, self.meta["bits"])
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if self.kind == "float":
            return F.linear(x, self.weight.to(x.dtype))
        if self.kind == "int4_cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(_INT4_CPU_DTYPE), self.packed, 32, self.scale_zero)
            return y.to(x.dtype)
        if self.kind == "triton":
            kern = importlib.import_module("ember.kernels.gguf_matmul")
            return kern.gguf_matmul(x, self.codes, self.scale, getattr(self, "min", None),
                                    n=self.rows, **self.meta)
        # "dequant": per call, into the activation dtype
        return F.linear(x, self.affine().dequantize().to(x.dtype))

    def prepare_for_compile(self) -> None:
        if self.kind == "native":
            native.quant_linear_op()

    def affine(self) -> AffineCodes:
        m = self.meta
        return AffineCodes(self.codes, self.scale, getattr(self, "min", None), m["offset"],
                           m["group"], m["bits"])

    def extra_repr(self) -> str:
        return f"rows={self.rows}, {self.kind}"


def _part_for(weights: list[tuple[Any, torch.Tensor, tuple[int, int]]],
              device: torch.device) -> _Part:
    """One compute form for shards of the same kind, rows concatenated."""
    qtypes = {q for q, _, _ in weights}
    rows = sum(shape[0] for _, _, shape in weights)
    if qtypes <= set(FLOAT_TYPES) or None in qtypes:
        w = torch.cat([t.float() if q is None else _float(t, q, s) for q, t, s in weights])
        return _Part(rows, "float", {"weight": w.to(device)}, {})
    ac = [decode_blocks(t, q, s) for q, t, s in weights]
    codes = torch.cat([a.codes for a in ac])
    scale = torch.cat([a.scale for a in ac])
    mins = [a.min for a in ac]
    mn = None if all(m is None for m in mins) else torch.cat(
        [torch.zeros_like(a.scale) if a.min is None else a.min for a in ac])
    first = ac[0]
    meta = {"offset": first.offset, "group": first.group, "bits": first.bits,
            "k": codes.shape[1]}  # fmt: skip
    if _use_triton(device):
        kern = importlib.import_module("ember.kernels.gguf_matmul")
        stored = kern.pack_nibbles(codes) if first.bits == 4 else codes
        tensors = {"codes": stored.to(device), "scale": scale.to(device)}
        if mn is not None:
            tensors["min"] = mn.to(device)
        return _Part(rows, "triton", tensors, meta)
    if first.group == 32 and _native_kernel():
        offset = mn if mn is not None else torch.zeros_like(scale)
        if first.bits == 4:  # codes 0..15, the offset folded into the min
            bits, blocks = 4, native.pack(codes, scale, offset - first.offset * scale, bits=4)
        else:  # codes less their offset fit int8 (5- and 8-bit types)
            bits, blocks = 8, native.pack(codes.to(torch.int16) - first.offset, scale, offset,
                                          bits=8)
        if blocks is not None:
            return _Part(rows, "native", {"blocks": blocks}, {**meta, "bits": bits})
    if first.bits == 4 and first.group == 32:
        zero = (mn if mn is not None else torch.zeros_like(scale)) + (8 - first.offset) * scale
        # int4pack wants codes - 8 in [-8, 7] meaning (q - 8): ours are q in [0, 15].
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        tensors = {"packed": packed, "scale_zero": scale_zero.to(_INT4_CPU_DTYPE)}
        return _Part(rows, "int4_cpu", tensors, meta)
    tensors = {"codes": codes, "scale": scale}
    if mn is not None:
        tensors["min"] = mn
    return _Part(rows, "dequant", tensors, meta)


def _native_kernel() -> bool:
    """Whether ember's native quantized CPU kernel runs here on AVX512-BF16 (its plain-C build,
    for CPUs without, is slower than torch's int4 matmul)."""
    return native.native_bf16()


def _float(t: torch.Tensor, qtype: Any, shape: tuple[int, int]) -> torch.Tensor:
    from ember.quantization.gguf_blocks import dequantize

    return dequantize(t, qtype, shape)


def _kind(qtype: Any) -> Any:
    """Shards whose kind matches can share one part."""
    from ember.quantization.gguf_blocks import _LAYOUT

    if qtype is None or qtype in FLOAT_TYPES:
        return "float"
    group, offset, bits = _LAYOUT[qtype]
    return (group, offset, 4 if bits == 4 else 8, qtype)


class GGUFLinearMethod(LinearMethod):
    """Keeps each shard's GGUF blocks as loaded, then builds the compute parts."""

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:  # fmt: skip
        if layer.tp_size > 1:
            raise ValueError("the gguf quantization method does not support tensor parallelism")
        # A placeholder under the HF name, so the load loop finds the weight; the loaded blocks
        # go to layer._gguf_shards and the compute form to layer.gguf_parts.
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.register_weight("weight", weight, {"output_dim": 0, "input_dim": 1,
                                                 "weight_loader": self.weight_loader})
        layer._gguf_shards = {}  # type: ignore[assignment]

    @staticmethod
    def weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None) -> None:
        layer = getattr(param, "_ember_layer", None)
        name = getattr(param, "_ember_name", "weight")
        if layer is None:
            raise ValueError(f"weight {name!r}: the gguf method loads linear layers only")
        offset, rows = shard_offset_size(layer, shard_id)
        qtype = getattr(loaded, "gguf_qtype", None)
        if qtype is not None and qtype not in SUPPORTED:
            raise ValueError(f"weight {name!r} has GGUF type {qtype.name}, which the gguf method "
                             f"cannot compute on (supported: "
                             f"{', '.join(q.name for q in SUPPORTED)} and float types)")
        shape = tuple(getattr(loaded, "gguf_shape", loaded.shape))
        if shape != (rows, layer.in_features):
            raise ValueError(f"weight {name!r} has shape {shape}, the model expects "
                             f"{(rows, layer.in_features)}")
        layer._gguf_shards[offset] = (qtype, loaded, shape)

    def process_weights_after_loading(self, layer: Linear) -> None:
        shards = [layer._gguf_shards[o] for o in sorted(layer._gguf_shards)]
        if not shards:
            raise ValueError(f"layer {layer.prefix!r}: no GGUF weights were loaded")
        device = layer.weight.device
        groups: list[list[Any]] = []
        for shard in shards:
            if groups and _kind(groups[-1][0][0]) == _kind(shard[0]):
                groups[-1].append(shard)
            else:
                groups.append([shard])
        layer.gguf_parts = nn.ModuleList(_part_for(g, device) for g in groups)
        # Plain bound methods: a decode step calls 120 of these layers, and nn.Module's call
        # machinery and ModuleList indexing cost more than a small int4 matmul.
        layer._gguf_forwards = [p.forward for p in layer.gguf_parts]
        layer._gguf_shards = {}

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        forwards = layer._gguf_forwards
        if x.dim() != 2:
            return self.apply(layer, x.reshape(-1, x.shape[-1]), bias).view(*x.shape[:-1], -1)
        y = forwards[0](x) if len(forwards) == 1 else torch.cat([f(x) for f in forwards], -1)
        return y if bias is None else y + bias
