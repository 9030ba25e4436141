"""The model-side attention layer and the per-step ForwardContext that feeds it.

Models never see backends directly: each ``Attention`` builds its backend impl once, and at run
time picks its own KV-cache tensor (by layer index) and the step's metadata from the
``ForwardContext`` the model runner passes down through ``model.forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ember.attention_backends.base import AttentionBackend, AttentionMetadata
from ember.kernels import dispatch
from ember.kernels.config import kernel_config
from ember.layers.linear import Linear, QuantizedActivation, wanted_input_dtype
from ember.layers.rotary import PendingRotation


@dataclass
class ForwardContext:
    """What one forward pass needs besides the token ids and positions."""

    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer, in layer order (backend.kv_cache_shape)


class Attention(nn.Module):
    """Paged attention of one layer: stores this step's K/V and attends through the backend."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        attn_backend: type[AttentionBackend],
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.backend = attn_backend
        self.impl = attn_backend.impl_cls()(
            num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap
        )
        self._op_key: int | None = None  # this layer in ember::attention calls (if compiled)
        self.quantized_producer = kernel_config().quantized_producers
        self.hands_rotation_over = kernel_config().rotary_in_attention

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
        quant_for: Linear | None = None, rotation: PendingRotation | None = None,
    ) -> torch.Tensor | QuantizedActivation:
        """q: [T, num_heads(*head_size)], k/v: [T, num_kv_heads(*head_size)] -> [T, H * D].

        ``quant_for``: the projection the output feeds. Where it asks for its input quantized
        (``Linear.quantized_input_dtype``) and the backend writes that form
        (``AttentionImpl.writes_quantized``), the result may come as a QuantizedActivation.
        ``rotation``: q and k are not rotated yet; the backend rotates them as it attends
        where it can (``AttentionImpl.fuses_rotary``, with KernelConfig.rotary_in_attention),
        else this layer first.
        """
        if self._op_key is not None and torch.compiler.is_compiling():
            if rotation is not None:
                q, k = rotation.apply(q, k)
            # One opaque call in the traced graph (ember.layers.compiled_attention).
            return torch.ops.ember.attention(q, k, v, self._op_key)
        return self.eager_forward(q, k, v, ctx, quant_for, rotation)

    def eager_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
        quant_for: Linear | None = None, rotation: PendingRotation | None = None,
    ) -> torch.Tensor | QuantizedActivation:
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        kwargs = {}
        if rotation is not None:
            tables = (rotation.tables_to_hand_over(q) if self.hands_rotation_over
                      and self.impl.fuses_rotary(rotation.rope.rotary_dim) else None)
            if tables is None:
                q, k = rotation.apply(q, k)
            else:
                kwargs["rotary"] = tables
        args = (q, k, v.view(t, self.num_kv_heads, self.head_size),
                ctx.kv_caches[self.layer_idx], ctx.attn_metadata)
        dtype = (wanted_input_dtype(quant_for, q.view(t, -1))
                 if self.quantized_producer and quant_for is not None and dispatch.on_gpu(q)
                 else None)
        if dtype is not None and self.impl.writes_quantized(dtype):
            out = self.impl.forward(*args, quantize=dtype, **kwargs)
            return out if isinstance(out, torch.Tensor) else QuantizedActivation(*out)
        return self.impl.forward(*args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, backend={self.backend.name or self.backend.__name__}, "
            f"sliding_window={self.sliding_window}"
        )
