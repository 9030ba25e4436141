"""Which runner a model gets, and its pooling set-up as the checkpoint declares it.

`resolve_runner`: vLLM's `runner` ("auto" | "generate" | "pooling"). "auto" picks pooling for
architectures registered with capability runner="pooling" (encoder-only BERT) and for every
`*ForSequenceClassification`; a causal LM runs as a pooling model only when asked.

`PoolerConfig.from_checkpoint`: sentence-transformers' `modules.json` names the Pooling module
(its `config.json` gives the mode, a PoolerRegistry name) and a Normalize module (normalize);
without it the model class's default pooling applies and embeddings are normalized (vLLM's
default). `is_matryoshka` / `matryoshka_dimensions` in config.json allow `dimensions`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

RUNNERS = ("auto", "generate", "pooling")
# sentence-transformers' Pooling flags -> PoolerRegistry names (a plugin may add the last three).
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
             "pooling_mode_weightedmean_tokens": "weightedmean"}


def resolve_runner(requested: str, arch: str) -> str:
    from ember.registry import ModelRegistry

    if requested not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {requested!r}")
    caps = ModelRegistry.entry(arch).capabilities if arch in ModelRegistry else {}
    pooling_only = caps.get("runner") == "pooling" or arch.endswith("ForSequenceClassification")
    if requested == "auto":
        return "pooling" if pooling_only else "generate"
    if requested == "generate" and pooling_only:
        raise ValueError(f"{arch} is a pooling model (embeddings / classification): it cannot "
                         "generate text; use runner='pooling' (or 'auto')")
    return requested


def st_max_seq_length(path: str) -> int | None:
    """sentence-transformers' max_seq_length, when the checkpoint has one."""
    cfg = _read_json(os.path.join(path, "sentence_bert_config.json")) if os.path.isdir(path) else None
    value = (cfg or {}).get("max_seq_length")
    return value if isinstance(value, int) and value > 0 else None


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # a PoolerRegistry name
    normalize: bool
    matryoshka: bool | list[int] = False

    @classmethod
    def from_checkpoint(cls, path: str, hf_config: Any, default_pooling: str) -> PoolerConfig:
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        matryoshka: bool | list[int] = list(dims) if dims else bool(
            getattr(hf_config, "is_matryoshka", False))
        modules = _read_json(os.path.join(path, "modules.json")) if os.path.isdir(path) else None
        if not modules:
            return cls(default_pooling, True, matryoshka)
        pooling, normalize = default_pooling, False
        for module in modules:
            kind = str(module.get("type", ""))
            if kind.endswith(".Pooling"):
                pooling = _st_pooling_mode(os.path.join(path, module.get("path", ""), "config.json"))
            elif kind.endswith(".Normalize"):
                normalize = True
        return cls(pooling, normalize, matryoshka)


def _st_pooling_mode(config_path: str) -> str:
    from ember.registry import PoolerRegistry

    cfg = _read_json(config_path) or {}
    modes = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
    if len(modes) != 1:
        raise ValueError(f"{config_path}: expected exactly one pooling mode of "
                         f"{', '.join(_ST_MODES)}, got {modes or 'none'}")
    if modes[0] not in PoolerRegistry:
        raise ValueError(f"{config_path} asks for {modes[0]!r} pooling, which no registered "
                         f"pooler provides (registered: {', '.join(PoolerRegistry.names())}); a "
                         "plugin can add it with the ember_register_poolers hook")
    return modes[0]
