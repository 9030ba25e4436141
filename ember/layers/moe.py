"""Mixture-of-experts layers: top-k routing, experts held as stacked tensors, and the choice
between the fused Triton path (CUDA) and the torch path (everywhere else).

Routing is HF transformers': softmax over the router logits in float32, top-k, then (when the
model says so) the k weights renormalised to sum to one. Expert weights live in two stacked
tensors, ``w13`` [E, 2I, H] (gate rows then up rows, one fused gate_up per expert) and ``w2``
[E, H, I]; checkpoints name them per expert and ``load_expert_weight`` places each one.

On CUDA (outside torch.compile) the experts run as ember.kernels.fused_moe: tokens sorted by
expert on the device, two grouped GEMMs over the experts that were hit (a few tokens instead
take ember.kernels.moe_decode: two weight-streaming kernels, no sort), no host sync, so CUDA
graphs capture it; at decode batch sizes the router runs inside the norm before the block
(``forward_after_norm``). Elsewhere the torch path loops over the experts that received
tokens, in HF's order and with HF's arithmetic, so float32 results equal HF's exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember import kernels
from ember.kernels import dispatch
from ember.layers.linear import small_batch_max_rows
from ember.layers.norm import RMSNorm


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          weight_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(topk_weights [T, k], topk_ids [T, k] int64) from router logits [T, E], as HF routes:
    float32 softmax, top-k, optional renormalisation; the weights are cast to
    ``weight_dtype`` (Qwen3-MoE casts them to the activations' dtype) or kept float32 (None:
    Mixtral)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weight_dtype is not None:
        weights = weights.to(weight_dtype)
    return weights, ids


def moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The experts in torch: for each expert that received tokens (ascending), its rows in
    HF's order (by top-k slot, then token), gate_up, SiLU * up, down, times the routing weight,
    added into the output. Op for op what transformers does, so float32 matches it exactly.
    Host syncs (which experts were hit): not for CUDA graphs."""
    num_experts = w13.shape[0]
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    # [E, k, T]: which (slot, token) pairs chose each expert.
    mask = F.one_hot(topk_ids, num_classes=num_experts).permute(2, 1, 0)
    hit = (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist()
    for e in hit:
        slot, tok = torch.where(mask[e])
        h = F.linear(x[tok], w13[e])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        h = F.linear(h, w2[e]) * topk_weights[tok, slot, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


class Router(nn.Module):
    """The router's [E, H] weight (HF's ``gate``). Not a ``Linear``: quantization methods
    replace linear layers, and the routing decision stays in the checkpoint's precision."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        # Decode batches on CUDA in half precision take the weight-streaming kernel, as Linear
        # layers do (it launches with PDL; cuBLAS's gemv does not).
        self.small_batch_max_rows = (small_batch_max_rows(hidden_size, num_experts)
                                     if dispatch.layer_kernels_enabled() else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_batch_max_rows and dispatch.takes_kernel(x):
            return kernels.small_batch_linear.small_batch_linear(x, self.weight)
        return F.linear(x, self.weight)


def load_expert_weight(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
    """Weight loader of the stacked expert tensors (the linear-layer contract's signature).

    ``shard_id``: None for the whole stacked tensor (a checkpoint that stores experts fused,
    transformers 5's layout); ``(expert, None)`` for one expert's w2; ``(expert, 0 | 1)`` for
    one expert's gate (0) or up (1) rows of w13. ValueError on a shape mismatch."""
    dst = param.data
    if shard_id is not None:
        expert, shard = shard_id
        if not 0 <= expert < dst.shape[0]:
            raise ValueError(f"expert {expert} out of range: the layer has {dst.shape[0]}")
        dst = dst[expert]
        if shard is not None:
            half = dst.shape[0] // 2
            dst = dst.narrow(0, shard * half, half)
    if tuple(loaded.shape) != tuple(dst.shape):
        raise ValueError(f"expert weight has shape {tuple(loaded.shape)}, "
                         f"the model expects {tuple(dst.shape)} (shard {shard_id})")
    dst.copy_(loaded)


class FusedMoE(nn.Module):
    """``num_experts`` SwiGLU experts as stacked tensors, applied to top-k routed tokens.

    forward(x [T, H], router_logits [T, E]) -> [T, H]: sum over each token's k experts of
    weight * down(silu(gate(x)) * up(x))."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype,
                 weights_in_activation_dtype: bool = True) -> None:  # fmt: skip
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts="
                             f"{num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.weights_in_activation_dtype = weights_in_activation_dtype
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype))
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype))
        for p in (self.w13, self.w2):
            p.weight_loader = load_expert_weight  # type: ignore[attr-defined]
        self.use_kernel = dispatch.triton_installed()

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and dispatch.on_gpu(x):
            return kernels.fused_moe.fused_moe(
                x, self.w13, self.w2, router_logits, self.top_k, self.renormalize,
                round_weights=self.weights_in_activation_dtype,
            )
        weight_dtype = x.dtype if self.weights_in_activation_dtype else None
        weights, ids = route(router_logits, self.top_k, self.renormalize, weight_dtype)
        return moe_torch(x, self.w13, self.w2, weights, ids)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, renormalize={self.renormalize}")


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE feed-forward: the router (``gate``) and the ``experts``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype,
                 weights_in_activation_dtype: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.gate = Router(hidden_size, num_experts, dtype)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                dtype, weights_in_activation_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))

    def forward_after_norm(self, h: torch.Tensor, residual: torch.Tensor,
                           norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(this block on norm(h + residual), h + residual): the decoder layer's closing add and
        norm, then the block. At decode batch sizes on CUDA the add, the norm and the router
        are one kernel (ember.kernels.rms_norm.fused_add_rms_norm_router)."""
        if self._router_fuses(h, norm):
            x, residual, logits = kernels.rms_norm.fused_add_rms_norm_router(
                h, residual, norm.weight, norm.eps, self.gate.weight)
            return self.experts(x, logits), residual
        x, residual = norm.forward_with_residual(h, residual)
        return self(x), residual

    def _router_fuses(self, h: torch.Tensor, norm: RMSNorm) -> bool:
        return (norm.use_kernel and type(norm) is RMSNorm and h.dim() == 2
                and h.shape[0] <= self.gate.small_batch_max_rows and dispatch.takes_kernel(h)
                and norm.weight.dtype == h.dtype == self.gate.weight.dtype)
