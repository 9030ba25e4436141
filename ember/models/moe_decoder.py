"""The Llama-family decoder with mixture-of-experts feed-forward layers (Qwen3-MoE, Mixtral).

Attention, norms, rotary embedding, the dense MLP of non-sparse layers, the forward pass and the
logits are the Llama family's (ember.models.llama); this class swaps each sparse layer's MLP
for a ``SparseMoeBlock`` and loads HF checkpoints whose experts are named one by one
(``...experts.<e>.<proj>.weight``) into the stacked ``w13`` / ``w2`` tensors. Checkpoints
saved in transformers 5's fused layout (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]) load too.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn

from ember.attention_backends.base import AttentionBackend
from ember.layers.moe import FusedMoE, SparseMoeBlock, load_expert_weight
from ember.models.hf_weights import FUSED, listed_names
from ember.models.llama import LlamaForCausalLM

_SHARDS = {"qkv_proj": (0, 1, 2), "gate_up_proj": (0, 1)}
_PER_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED_EXPERTS = {"gate_up_proj": "w13", "down_proj": "w2"}


class MoeForCausalLM(LlamaForCausalLM):
    """A causal LM whose sparse layers' ``mlp`` is a SparseMoeBlock. Subclasses say which layers
    are sparse, how the config names the expert counts, and how checkpoints name experts."""

    # The experts are not split over ranks or stages (the engine refuses tensor_parallel_size
    # or pipeline_parallel_size > 1 for these models).
    supports_tensor_parallel: ClassVar[bool] = False
    supports_pipeline_parallel: ClassVar[bool] = False

    # Checkpoint name of the MoE block where it is not "mlp" (Mixtral: "block_sparse_moe").
    moe_block_name: ClassVar[str] = "mlp"
    # Per-expert projection name -> shard of w13 (0 gate, 1 up) or None for w2.
    expert_projections: ClassVar[dict[str, int | None]] = {
        "gate_proj": 0, "up_proj": 1, "down_proj": None}  # fmt: skip
    # Routing weights cast to the activation dtype before they scale expert outputs (Qwen3-MoE)
    # or kept in float32 (Mixtral), as HF does.
    routing_weights_in_activation_dtype: ClassVar[bool] = True

    def __init__(self, config: Any, attn_backend: type[AttentionBackend],
                 dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        quant = getattr(config, "quantization_config", None)
        if quant:  # expert tensors are float only: a quantized checkpoint's would not load
            method = (quant.get("quant_method") if isinstance(quant, dict)
                      else getattr(quant, "quant_method", quant))
            raise ValueError(f"{type(self).__name__}: quantized checkpoints (quant_method "
                             f"{method!r}) are not supported; the experts load float weights")
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}: only silu is implemented")
        # The parent builds dense MLPs everywhere (free: models are built on the meta device);
        # the sparse layers' are replaced.
        super().__init__(config, attn_backend, dtype)
        num_experts, top_k, inter, renormalize = self.moe_shape(config)
        for i, layer in enumerate(self.model.layers):
            if self.is_sparse_layer(config, i):
                layer.mlp = SparseMoeBlock(
                    config.hidden_size, num_experts, top_k, inter, renormalize, dtype,
                    self.routing_weights_in_activation_dtype,
                )

    @classmethod
    def moe_shape(cls, config: Any) -> tuple[int, int, int, bool]:
        """(num_experts, top_k, expert intermediate size, renormalise top-k weights)."""
        raise NotImplementedError

    @classmethod
    def is_sparse_layer(cls, config: Any, layer_idx: int) -> bool:
        return True

    # ---- weight loading ----------------------------------------------------------------------

    def _target(self, hf_name: str) -> tuple[str, Any]:
        """Our parameter name for an HF name, and the shard the tensor fills (None: all of it;
        an int: a fused dense projection's shard; (expert, shard): a stacked expert tensor)."""
        block = f".{self.moe_block_name}."
        if self.moe_block_name != "mlp" and block in hf_name:
            hf_name = hf_name.replace(block, ".mlp.", 1)
        match = _PER_EXPERT.match(hf_name)
        if match is not None and match["proj"] in self.expert_projections:
            shard = self.expert_projections[match["proj"]]
            stacked = "w2" if shard is None else "w13"
            return f"{match['prefix']}.experts.{stacked}", (int(match["e"]), shard)
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in _FUSED_EXPERTS:
            return ".".join([*parts[:-1], _FUSED_EXPERTS[parts[-1]]]), None
        return super()._target(hf_name)

    def expected_weight_names(self) -> set[str]:
        """Every HF name a per-expert checkpoint must provide."""
        names = set()
        by_shard = {shard: proj for proj, shard in self.expert_projections.items()}
        for name, shards in self._required().items():
            parts = name.split(".")
            if parts[-1] in ("w13", "w2"):
                prefix = ".".join(parts[:-1]).replace(".mlp.", f".{self.moe_block_name}.", 1)
                names.update(f"{prefix}.{e}.{by_shard[s]}.weight" for e, s in shards)
            elif shards:
                fused = {v: k for k, v in FUSED.items() if v[0] == parts[-2]}
                names.update(".".join([*parts[:-2], fused[(parts[-2], s)], parts[-1]])
                             for s in shards)
            elif name.endswith(".mlp.gate.weight"):  # the router, under the block's name
                names.add(name.replace(".mlp.", f".{self.moe_block_name}.", 1))
            else:
                names.add(name)
        if self.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def _required(self) -> dict[str, set[Any]]:
        """Per parameter, the shards that fill it whole (an empty set: one unsharded tensor)."""
        required: dict[str, set[Any]] = {}
        for name, _ in self.named_parameters():
            parts = name.split(".")
            if parts[-1] in ("w13", "w2"):
                experts = self.get_submodule(name.rsplit(".", 1)[0]).num_experts
                shards = (0, 1) if parts[-1] == "w13" else (None,)
                required[name] = {(e, s) for e in range(experts) for s in shards}
            elif len(parts) >= 2 and parts[-2] in _SHARDS:
                required[name] = set(_SHARDS[parts[-2]])
            else:
                required[name] = set()
        return required

    def _copy_shard(self, name: str, param: nn.Parameter, tensor: torch.Tensor, shard: Any,
                    hf_name: str) -> None:  # fmt: skip
        """Experts through ``load_expert_weight``; everything else through its parameter's
        ``weight_loader`` (narrowing to a fused projection's shard, checking the shape)."""
        # Experts by their module: attributes set on a parameter do not survive to_empty off
        # the meta device (it makes new Parameters); Linear layers restore theirs.
        owner = self.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(owner, FusedMoE):
            try:
                load_expert_weight(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"weight {hf_name!r}: {e}") from e
            return
        super()._copy_shard(name, param, tensor, shard, hf_name)

    def _check_complete(self, loaded: set[str], filled: dict[str, set[Any]]) -> None:
        """By shards, not names: a stacked expert tensor is whole once every expert's shards
        came, whether named one by one or in transformers 5's fused layout."""
        missing = []
        for name, shards in self._required().items():
            have = filled.get(name, set())
            if None in have or (shards and shards <= have):
                continue  # filled whole, or by every shard
            missing.append(name if not shards else f"{name} (shards {_shards(shards - have)})")
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {listed_names(missing)}")


def _shards(shards: set[Any], limit: int = 8) -> str:
    listed = sorted(shards, key=str)
    more = f" ... and {len(listed) - limit} more" if len(listed) > limit else ""
    return ", ".join(map(str, listed[:limit])) + more
