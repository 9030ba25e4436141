"""Quantized checkpoints made locally from a float one, in the published layouts, plus the float
checkpoint of the very weights they hold (the reference HF transformers runs).

    write_quantized_checkpoint(src, dst, "awq", dequantized_dir=ref, group_size=128)

quantizes every decoder projection of the safetensors checkpoint ``src`` (round to nearest, not
a calibrated search: the point is the layout, not the accuracy), writes ``dst`` with the
method's tensors and a config.json carrying the method's ``quantization_config``, and writes
``ref`` with the dequantized float32 weights and no quantization_config. The per-tensor
functions (``awq_tensors``, ``gptq_tensors``, ``fp8_tensors``) return a weight's checkpoint
tensors and its dequantized value; the checks of ember.testing.quantized_linear use them too.
Layouts: ember.quantization.int4_common (AWQ "gemm", GPTQ v1/v2) and compressed-tensors' /
vLLM's fp8 (weight float8_e4m3fn [out, in] and weight_scale float32 [out, 1] per channel, or one
per tensor).
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any

import torch

from ember.quantization.int4_common import AWQ_ORDER, pack_int4, quantize_int4

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def _int4(weight: torch.Tensor, group_size: int, sym: bool):
    """q [in, out], zeros [G, out], float16 scales and the float32 [out, in] they dequantize to."""
    q, zeros, scales = quantize_int4(weight.float().t(), group_size, sym)
    scales = scales.half()
    group = q.shape[0] if group_size == -1 else group_size
    deq = (q - zeros.repeat_interleave(group, 0)).float() * scales.float().repeat_interleave(
        group, 0)
    return q, zeros, scales, deq.t().contiguous()


def awq_tensors(weight: torch.Tensor, group_size: int = 128,
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AWQ "gemm" tensors of a float weight [out, in], and its dequantized float32 value."""
    q, zeros, scales, deq = _int4(weight, group_size, sym=False)
    return {"qweight": pack_int4(q, 1, AWQ_ORDER), "qzeros": pack_int4(zeros, 1, AWQ_ORDER),
            "scales": scales}, deq


def gptq_tensors(weight: torch.Tensor, group_size: int = 128, desc_act: bool = False,
                 sym: bool = True, checkpoint_format: str = "gptq", seed: int = 0,
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ tensors of a float weight [out, in] and its dequantized float32 value. With
    desc_act the rows are grouped in a random order (g_idx), as act-order quantization leaves
    them; ``seed`` fixes the order (give the shards of one fused projection the same seed)."""
    k = weight.shape[1]
    group = k if group_size == -1 else group_size
    perm = torch.arange(k)
    if desc_act:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    # Quantize in group order: row perm[i] belongs to group i // group.
    q_sorted, zeros, scales, deq_sorted = _int4(weight[:, perm], group_size, sym)
    q = torch.empty_like(q_sorted)
    q[perm] = q_sorted
    deq = torch.empty_like(deq_sorted)
    deq[:, perm] = deq_sorted
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    stored = (zeros - 1) & 0xF if checkpoint_format == "gptq" else zeros
    return {"qweight": pack_int4(q, 0), "qzeros": pack_int4(stored, 1), "scales": scales,
            "g_idx": g_idx}, deq


def fp8_tensors(weight: torch.Tensor, strategy: str = "channel",
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """fp8 (e4m3) tensors of a float weight [out, in]: "channel" (weight_scale [out, 1]) or
    "tensor" (one scale), and the dequantized float32 value."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = scale.reshape(-1, 1) if strategy == "channel" else scale.reshape(1)
    return {"weight": q, "weight_scale": scale.float()}, q.float() * scale


def quantization_config(method: str, **opts: Any) -> dict[str, Any]:
    """The config.json ``quantization_config`` each tool writes for these tensors."""
    group = opts.get("group_size", 128)
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group,
                "desc_act": opts.get("desc_act", False), "sym": opts.get("sym", True),
                "checkpoint_format": opts.get("checkpoint_format", "gptq"),
                "true_sequential": True, "damp_percent": 0.01, "static_groups": False}
    if method == "fp8":  # compressed-tensors' FP8_DYNAMIC scheme
        strategy = opts.get("strategy", "channel")
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                "symmetric": True, "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                          "symmetric": True, "dynamic": True}}}}
    raise ValueError(f"no checkpoint writer for quantization method {method!r}")


def _quantize(name: str, weight: torch.Tensor, method: str, opts: dict[str, Any],
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if method == "awq":
        return awq_tensors(weight, opts.get("group_size", 128))
    if method == "gptq":
        # One act order per input: q/k/v share theirs, gate/up theirs (they quantize the same
        # activations, so GPTQ's order matches); a stable seed per (layer, input).
        module = name.rsplit(".", 1)[0]
        layer, proj = module.rsplit(".", 2)[0], module.rsplit(".", 1)[-1]
        source = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                  "up_proj": "gate_up"}.get(proj, proj)
        seed = zlib.crc32(f"{layer}/{source}".encode())
        return gptq_tensors(weight, opts.get("group_size", 128), opts.get("desc_act", False),
                            opts.get("sym", True), opts.get("checkpoint_format", "gptq"), seed)
    return fp8_tensors(weight, opts.get("strategy", "channel"))


def write_quantized_checkpoint(src: str, dst: str, method: str, dequantized_dir: str | None = None,
                               **opts: Any) -> None:
    """See the module docstring. ``opts``: group_size, desc_act, sym, checkpoint_format (GPTQ),
    strategy (fp8)."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for fname in sorted(os.listdir(src)):
        if fname.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, fname)))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS:
            parts, deq = _quantize(name, t, method, opts)
            quantized.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
            dequantized[name] = deq.float()
        else:
            quantized[name] = t
            dequantized[name] = t.float() if t.is_floating_point() else t
    for out_dir, data, qc in ((dst, quantized, quantization_config(method, **opts)),
                              (dequantized_dir, dequantized, None)):
        if out_dir is None:
            continue
        os.makedirs(out_dir, exist_ok=True)
        for fname in os.listdir(src):  # tokenizer, generation config...
            path = os.path.join(src, fname)
            if os.path.isfile(path) and fname != "config.json" and ".safetensors" not in fname:
                shutil.copy(path, os.path.join(out_dir, fname))
        save_file(data, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        config.pop("quantization_config", None)
        if qc is not None:
            config["quantization_config"] = qc
        else:
            config["torch_dtype"] = "float32"
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
