"""Reading a checkpoint's ``quantization_config`` (config.json), shared by the checkpoint methods
(awq, gptq, fp8): the config as a plain dict, a value under any of the names the tools write,
and whether a layer is one the checkpoint left unquantized."""

from __future__ import annotations

from typing import Any


def quantization_config_dict(hf_config: Any) -> dict[str, Any]:
    """The checkpoint's quantization_config as a plain dict ({} when there is none)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return {}
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return dict(qc)


def first_of(qc: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first key present (tools spell the same setting differently, e.g.
    AutoAWQ's ``w_bit`` and transformers' ``bits``)."""
    for key in keys:
        if qc.get(key) is not None:
            return qc[key]
    return default


def module_skipped(prefix: str, modules: list[str] | None) -> bool:
    """Whether a layer named ``prefix`` is one of ``modules`` (the checkpoint's unquantized
    modules), matched as a whole dotted component path as AutoAWQ and GPTQ name them."""
    parts = f".{prefix}."
    return any(f".{m.strip('.')}." in parts for m in modules or [])
