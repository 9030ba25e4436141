"""Loading HF-named checkpoints into decoders with fused projections: the one load loop that
the Llama family, its mixture-of-experts variant and Gemma share.

HF stores q/k/v and gate/up as separate tensors; ember's decoders hold each pair or triple as
one fused ``Linear`` (ember.layers.linear), so a checkpoint name maps to a fused parameter and
the index of its shard there. Each tensor goes to its parameter's ``weight_loader`` (the
linear contract: it narrows, checks the shape, casts and copies). Unknown and missing names are
a ValueError that lists them.

A model overrides the hooks where its tensors differ: ``_target`` (names, e.g. stacked
experts), ``_copy_shard`` (how a tensor lands), ``_check_complete`` (what "all loaded" means),
``_other_stage`` (weights a pipeline stage skips).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ember.layers.linear import bind_weight_loaders, weight_loader

# HF buffers some checkpoints carry; they are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# HF projection name -> (our fused projection, index of its shard), and back.
FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}  # fmt: skip
UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def listed_names(names: Iterable[str], limit: int = 20) -> str:
    """Sorted names for an error message, the first `limit` of them."""
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class FusedHFWeightsMixin:
    """``load_weights`` for an ``nn.Module`` whose fused projections follow FUSED's names and
    which sets ``tie_word_embeddings``."""

    tie_word_embeddings: bool

    def _target(self, hf_name: str) -> tuple[str, Any]:
        """Our parameter name for an HF name, and the shard index within a fused projection
        (None: the tensor fills the parameter whole)."""
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in FUSED:
            fused, shard = FUSED[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return hf_name, None

    def expected_weight_names(self) -> set[str]:
        """Every HF name the checkpoint must provide."""
        names = set()
        for name, _ in self.named_parameters():  # type: ignore[attr-defined]
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in UNFUSED:
                names.update(".".join([*parts[:-2], p, parts[-1]]) for p in UNFUSED[parts[-2]])
            else:
                names.add(name)
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Each HF-named tensor to its parameter's loader; ValueError on unknown, missing or
        mis-shaped names. Returns the names loaded. What the quantization method does after
        loading is the engine's next step (ember.quantization.base.finish_loading)."""
        params = bind_weight_loaders(self)  # type: ignore[arg-type]
        loaded: set[str] = set()
        filled: dict[str, set[Any]] = {}  # our parameter name -> the shards loaded into it
        unknown: list[str] = []
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: HF ties it to embed_tokens, and so do we
            target, shard = self._target(name)
            param = params.get(target)
            if param is None and self._other_stage(target):
                continue  # another pipeline stage's weight (read lazily, never copied here)
            if param is None:
                unknown.append(name)
                continue
            self._copy_shard(target, param, tensor, shard, name)
            filled.setdefault(target, set()).add(shard)
            loaded.add(name)
        if unknown:
            raise ValueError(f"unknown weights for {type(self).__name__}: "
                             f"{listed_names(unknown)}")
        self._check_complete(loaded, filled)
        return loaded

    def _copy_shard(self, name: str, param: nn.Parameter, tensor: torch.Tensor, shard: Any,
                    hf_name: str) -> None:  # fmt: skip
        """Load one tensor through its parameter's ``weight_loader``."""
        param._ember_name = hf_name  # type: ignore[attr-defined]  # errors name the HF weight
        weight_loader(param)(param, tensor, shard)

    def _check_complete(self, loaded: set[str], filled: dict[str, set[Any]]) -> None:
        """ValueError naming the weights the checkpoint lacked."""
        missing = self.expected_weight_names() - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {listed_names(missing)}")

    def _other_stage(self, name: str) -> bool:
        """Whether ``name`` is a weight another pipeline stage holds (none by default)."""
        return False
