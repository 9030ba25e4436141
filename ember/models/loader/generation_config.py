"""The model's own default sampling values (vLLM's `generation_config="auto"`).

An HF directory's generation_config.json, or a GGUF file's `general.sampling.*` metadata, may
say how the model wants to be sampled (e.g. temperature 0.6, top_p 0.95). vLLM uses those values
when the user gives no SamplingParams; so does ember. Only the keys vLLM reads are taken, renamed
to SamplingParams' names; `override_generation_config` is merged over them.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger("ember")

# generation_config.json key -> SamplingParams field (the set vLLM reads).
_HF_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
# GGUF metadata key (llama.cpp's sampling defaults) -> SamplingParams field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def _from_hf_dir(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable generation config ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a generation config must be a JSON object")
    return {ours: data[key] for key, ours in _HF_KEYS.items() if data.get(key) is not None}


def _from_gguf(path: str) -> dict[str, Any]:
    from ember.models.loader.gguf import read_gguf_header

    meta = read_gguf_header(path).metadata
    return {ours: meta[key] for key, ours in _GGUF_KEYS.items() if meta.get(key) is not None}


def default_sampling_values(model_path: str, generation_config: str,
                            override: dict[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments the model asks for by default.

    `generation_config`: "auto" reads the model's own (generation_config.json or GGUF metadata),
    "vllm" ignores it (SamplingParams' defaults), anything else is a folder holding a
    generation_config.json. `override` (vLLM's override_generation_config) wins over the file;
    its keys may use either name (max_new_tokens or max_tokens)."""
    if generation_config == "vllm":
        values: dict[str, Any] = {}
    elif generation_config == "auto":
        values = _from_gguf(model_path) if model_path.endswith(".gguf") else _from_hf_dir(model_path)
    else:
        values = _from_hf_dir(generation_config)
    for key, value in (override or {}).items():
        values[_HF_KEYS.get(key, key)] = value
    if values:
        from ember.sampling_params import SamplingParams

        try:
            SamplingParams(**values)  # refused here, at start-up, not at the first request
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the model's default sampling values {values} are invalid: {exc}") from exc
        logger.info("default sampling values from the model's generation config: %s "
                    "(generation_config='vllm' ignores them)", values)
    return values
