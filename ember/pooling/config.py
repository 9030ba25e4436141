"""Which runner a model gets, and its pooling set-up as the checkpoint declares it.

`resolve_runner`: vLLM's `runner` ("auto" | "generate" | "pooling") and `convert` ("auto" | "none" |
"embed" | "classify"; "reward" is refused), with the deprecated `task` mapped onto them as vLLM
does. "auto" picks pooling for architectures registered with capability runner="pooling"
(encoder-only BERT) and for every `*ForSequenceClassification`; a causal LM runs as a pooling
model (last-token embeddings) only when asked.

`PoolerConfig.from_checkpoint`: sentence-transformers' `modules.json` names the Pooling module
(its `config.json` gives the mode, a PoolerRegistry name) and a Normalize module (normalize);
without it the model class's default pooling applies and embeddings are normalized (vLLM's
default). `is_matryoshka` / `matryoshka_dimensions` in config.json allow `dimensions`.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ember")

RUNNERS = ("auto", "generate", "pooling")
# sentence-transformers' Pooling flags -> PoolerRegistry names (a plugin may add the last three).
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
             "pooling_mode_weightedmean_tokens": "weightedmean"}


# vLLM's `convert` (0.11+): how a model that is not natively a pooling model becomes one.
CONVERTS = ("auto", "none", "embed", "classify", "reward")
# vLLM's deprecated `task` -> (runner, convert), as vLLM maps it.
TASK_MAP = {"auto": ("auto", "auto"), "generate": ("generate", "auto"),
            "embed": ("pooling", "embed"), "embedding": ("pooling", "embed"),
            "classify": ("pooling", "classify"), "score": ("pooling", "classify"),
            "reward": ("pooling", "reward")}
REFUSED_TASKS = {"transcription": "speech-to-text models are not supported",
                 "draft": "draft models for speculative decoding are not supported"}
_warned_tasks: set[str] = set()


def check_task_and_convert(convert: str, task: str | None) -> None:
    """ValueErrors naming the field for values ember does not know (EngineArgs.validate)."""
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    if task is not None and task not in TASK_MAP:
        if task in REFUSED_TASKS:
            raise ValueError(f"task={task!r} is not supported: {REFUSED_TASKS[task]}")
        raise ValueError(f"task must be one of {', '.join(TASK_MAP)} (deprecated: use runner "
                         f"and convert), got {task!r}")


def runner_and_convert(runner: str, convert: str = "auto", task: str | None = None
                       ) -> tuple[str, str]:
    """(runner, convert) with vLLM's deprecated `task` folded in (with a warning)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    check_task_and_convert(convert, task)
    if task is None:
        return runner, convert
    t_runner, t_convert = TASK_MAP[task]
    hint = f"runner={t_runner!r}" + (f", convert={t_convert!r}" if t_convert != "auto" else "")
    message = f"task={task!r} is deprecated (as in vLLM 0.11): use {hint}"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    if task not in _warned_tasks:  # the log says it once per process
        _warned_tasks.add(task)
        logger.warning(message)
    if runner != "auto" and t_runner != "auto" and runner != t_runner:
        raise ValueError(f"task={task!r} means runner={t_runner!r}, but runner={runner!r} "
                         "was given: give runner and convert only")
    if convert != "auto" and t_convert != "auto" and convert != t_convert:
        raise ValueError(f"task={task!r} means convert={t_convert!r}, but convert={convert!r} "
                         "was given: give runner and convert only")
    return (t_runner if runner == "auto" else runner,
            t_convert if convert == "auto" else convert)


def resolve_runner(requested: str, arch: str, convert: str = "auto",
                   task: str | None = None) -> str:
    from ember.registry import ModelRegistry

    requested, convert = runner_and_convert(requested, convert, task)
    caps = ModelRegistry.entry(arch).capabilities if arch in ModelRegistry else {}
    pooling_only = caps.get("runner") == "pooling" or arch.endswith("ForSequenceClassification")
    if requested == "generate" and convert not in ("auto", "none"):
        raise ValueError(f"convert={convert!r} makes a pooling model: it needs runner='pooling' "
                         "(or 'auto'), not 'generate'")
    if requested == "auto":
        requested = "pooling" if pooling_only or convert not in ("auto", "none") else "generate"
    if requested == "generate" and pooling_only:
        raise ValueError(f"{arch} is a pooling model (embeddings / classification): it cannot "
                         "generate text; use runner='pooling' (or 'auto')")
    if requested == "pooling":
        _check_convert(arch, convert, pooling_only)
    return requested


def _check_convert(arch: str, convert: str, native: bool) -> None:
    classifier = arch.endswith("ForSequenceClassification")
    if convert == "reward":
        raise ValueError("convert='reward' (per-token reward scores) is not supported; a "
                         "*ForSequenceClassification reward model runs with convert='classify'")
    if convert == "none" and not native:
        raise ValueError(f"convert='none' keeps {arch} as it is, but it is not a pooling model: "
                         "use convert='embed' (last-token embeddings) or 'auto'")
    if convert == "embed" and classifier:
        raise ValueError(f"convert='embed' does not apply to {arch}, a classifier: use "
                         "convert='auto' or 'classify' (classify / score)")
    if convert == "classify" and not classifier:
        raise ValueError(f"convert='classify' needs a *ForSequenceClassification checkpoint "
                         f"(its trained score head); {arch} has none and ember does not add an "
                         "untrained one: use convert='embed'")


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
