"""From EngineArgs to the ModelConfig the engine runs with: where the model is (a local path, the
embedded default or a hub name), its HF config (overrides and quantization checked), dtype,
length limit and tokenizer."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.config import _DTYPE_ALIASES, EngineArgs, ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def resolve_model_path(model: str | None, revision: str | None = None,
                       download_dir: str | None = None, progress: bool | None = None) -> str:
    """The embedded default when None; a local directory or .gguf file that exists; else a hub
    name, whose config and tokenizer files are fetched (or found in the cache)."""
    return resolve_model_source(model, revision, download_dir, progress)[0]


def resolve_model_source(model: str | None, revision: str | None = None,
                         download_dir: str | None = None,
                         progress: bool | None = None) -> tuple[str, Any]:  # fmt: skip
    """(local path, HubModel or None): see ``resolve_model_path``."""
    if model is None:
        from ember.default_model import default_model_path

        _local_only(revision, download_dir, "the default model")
        return default_model_path(), None
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        from ember.models.loader import hub

        if not hub.looks_like_repo_id(model):
            raise ValueError(
                f"model {model!r} not found: expected a local HF-format directory (config.json + "
                "*.safetensors), a .gguf file, or a hub name such as 'org/name'"
            )
        found = hub.fetch_metadata(model, revision, download_dir, progress)
        return found.snapshot, found
    _local_only(revision, download_dir, repr(model))
    if os.path.isfile(path) and not path.endswith(".gguf"):
        raise ValueError(f"model {model!r} is a file but not a .gguf file")
    return path, None


def _local_only(revision: str | None, download_dir: str | None, what: str) -> None:
    # Every parameter works or is refused: these two mean nothing for a local model.
    for name, value in (("revision", revision), ("download_dir", download_dir)):
        if value is not None:
            raise ValueError(f"{name}={value!r} applies to hub names only; {what} is local")


def resolve_tokenizer_path(args: EngineArgs, hub: Any, progress: bool | None) -> str | None:
    """The tokenizer's local folder or file (None: the model's own), fetched from the hub when
    `tokenizer` is a hub name or `tokenizer_revision` is given. tokenizer_revision defaults to
    the model's revision when the tokenizer is the model's repo, else to the repo's default."""
    name = args.tokenizer
    if name is None:
        if args.tokenizer_revision is None or hub is None:
            if args.tokenizer_revision is not None:
                raise ValueError("tokenizer_revision applies to hub tokenizers only; the "
                                 "model is local and no tokenizer name is given")
            return None
        name = hub.repo_id
    if os.path.exists(os.path.expanduser(name)):
        if args.tokenizer_revision is not None:
            raise ValueError(f"tokenizer_revision applies to hub names only; tokenizer {name!r} "
                             "is local")
        return name
    from ember.models.loader import hub as hub_mod

    same_repo = hub is not None and name == hub.repo_id
    revision = args.tokenizer_revision or (args.revision if same_repo else None)
    if not hub_mod.looks_like_repo_id(name):
        raise ValueError(f"tokenizer {name!r} not found: not a local path nor a hub name")
    return hub_mod.fetch_tokenizer(name, revision, args.download_dir, progress)


def text_only_config(hf_config: PretrainedConfig, arch: str) -> PretrainedConfig:
    """The text config of a multimodal checkpoint whose architecture runs as text only (its
    registry entry declares "text_config"), carrying what ember reads from the top level."""
    text = hf_config.get_text_config()
    if text is hf_config:
        return hf_config
    text.architectures = [arch]
    for key in ("dtype", "quantization_config", "tie_word_embeddings"):
        value = getattr(hf_config, key, None)
        if value is not None:
            setattr(text, key, value)
    return text


def load_hf_config(path: str, trust_remote_code: bool = False) -> tuple[PretrainedConfig, bool]:
    """The HF config of a directory (config.json) or a GGUF file (its metadata, as a
    GGUFModelConfig: the same attributes without importing transformers' config classes)."""
    if path.endswith(".gguf"):
        from ember.models.loader.gguf import gguf_model_config

        return gguf_model_config(path), True
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model directory {path!r} has no config.json")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot read config.json of {path!r}: {exc}") from exc
    return config, False


def resolve_dtype(requested: str, hf_config: PretrainedConfig, platform) -> str:
    requested = _DTYPE_ALIASES.get(requested, requested)
    if requested == "auto":
        # CPUs default to float32 (exact, and fast without bf16 units); GPUs to the platform's.
        dtype = platform.default_dtype
        if platform.device_type != "cpu":
            cfg_dtype = str(getattr(hf_config, "torch_dtype", None) or "").replace("torch.", "")
            if cfg_dtype in ("float16", "bfloat16"):
                dtype = cfg_dtype
        return dtype
    if requested not in platform.supported_dtypes:
        raise ValueError(
            f"dtype {requested} is not supported on platform {platform.name}; "
            f"supported: {', '.join(platform.supported_dtypes)}"
        )
    return requested


def resolve_max_model_len(requested: int | None, hf_config: PretrainedConfig) -> int:
    derived = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            derived = value
            break
    if requested is None:
        if derived is None:
            raise ValueError("the model config gives no context length: set max_model_len")
        return derived
    if derived is not None and requested > derived:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={derived}"
        )
    return requested


def apply_hf_overrides(hf_config: PretrainedConfig, overrides: Any) -> PretrainedConfig:
    """vLLM's hf_overrides: a callable returns the new config; a dict sets attributes, and a
    dict given for a sub-config (e.g. "text_config") updates that sub-config's attributes."""
    if callable(overrides):
        result = overrides(hf_config)
        if result is None or not hasattr(result, "to_dict"):
            raise ValueError("hf_overrides: the function must return the (modified) config, "
                             f"got {type(result).__name__}")
        return result
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a dict or a function, got {type(overrides).__name__}")
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            apply_hf_overrides(current, value)
        else:
            setattr(hf_config, key, value)
    return hf_config


def check_quantization(requested: str | None, hf_config: PretrainedConfig, path: str,
                       is_gguf: bool) -> str | None:
    """The quantization method to use (a QuantizationRegistry name, None: float weights), from
    `quantization=` and the checkpoint's own metadata; ValueError on any mismatch
    (ember.quantization.base.resolve_quantization), never a silent float load."""
    from ember.quantization.base import resolve_quantization

    return resolve_quantization(requested, hf_config, path, is_gguf)


def resolve_model_config(args: EngineArgs, platform) -> ModelConfig:
    """The one place an EngineArgs becomes a ModelConfig (the front end and the engine core both
    call it: it reads config.json or GGUF metadata, never the weights)."""
    from ember.registry import ModelRegistry

    progress = None if args.show_progress else False
    path, hub = resolve_model_source(args.model, args.revision, args.download_dir, progress)
    hf_config, is_gguf = load_hf_config(path, args.trust_remote_code)
    hf_config = apply_hf_overrides(hf_config, args.hf_overrides)
    # By name only: the worker imports the class (ModelRegistry.resolve_model_cls) when it builds.
    arch = ModelRegistry.resolve_architecture(getattr(hf_config, "architectures", None) or [])
    if ModelRegistry.entry(arch).capabilities.get("text_config"):
        hf_config = text_only_config(hf_config, arch)
    if args.load_format == "gguf" and not is_gguf:
        raise ValueError(f"load_format='gguf' but {path!r} is not a .gguf file")
    quantization = check_quantization(args.quantization, hf_config, path, is_gguf)
    if args.load_format == "dummy" and quantization == "gguf":
        raise ValueError("load_format='dummy' cannot fill a .gguf file's quantized layers (the "
                         "gguf method computes on the file's own blocks); pass "
                         "quantization='none' for random float weights of its shapes")
    from ember.pooling.config import resolve_runner, st_max_seq_length

    runner = resolve_runner(args.runner, arch, args.convert, args.task)
    if runner == "pooling" and quantization == "gguf" and args.quantization is None:
        quantization = None  # pooling models run float weights: the GGUF is dequantized
    if runner == "pooling" and args.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={args.kv_cache_dtype!r}: pooling models keep no KV "
                         "cache")
    if runner == "pooling" and args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size}, pipeline_parallel_"
                         f"size={args.pipeline_parallel_size}: pooling models ({arch}) run in "
                         "one process")
    max_model_len = args.max_model_len
    if runner == "pooling" and max_model_len is None:
        max_model_len = st_max_seq_length(path)  # sentence-transformers' own limit
    max_model_len = resolve_max_model_len(max_model_len, hf_config)
    # Models whose rope depends on the context limit (LongRoPE: ember.layers.rotary) read it here.
    hf_config.ember_max_model_len = max_model_len
    return ModelConfig(
        path=path,
        hf_config=hf_config,
        architecture=arch,
        dtype=resolve_dtype(args.dtype, hf_config, platform),
        max_model_len=max_model_len,
        load_format=args.load_format,
        is_gguf=is_gguf,
        tokenizer=resolve_tokenizer_path(args, hub, progress),
        quantization=quantization,
        max_logprobs=args.max_logprobs,
        structured_outputs=_structured_outputs_config(args),
        default_sampling=_default_sampling(args, path),
        runner=runner,
        kv_cache_dtype=args.kv_cache_dtype,
        hub=hub,
    )


def _structured_outputs_config(args: EngineArgs):
    from ember.structured_output.config import StructuredOutputsConfig

    return StructuredOutputsConfig.of(args.structured_outputs_config)


def _default_sampling(args: EngineArgs, path: str) -> dict[str, Any]:
    from ember.models.loader.generation_config import default_sampling_values

    folder = args.generation_config
    if folder not in ("auto", "vllm"):
        folder = os.path.expanduser(folder)
    return default_sampling_values(path, folder, args.override_generation_config)


def engine_tokenizer_loader(args: EngineArgs, cfg: ModelConfig) -> Callable[[], Any]:
    """load_engine_tokenizer(args, cfg) as a picklable call (the grammar process makes its own
    tokenizer with it)."""
    import functools

    if args.skip_tokenizer_init:
        return _no_tokenizer
    from ember.tokenizer import load_tokenizer

    return functools.partial(load_tokenizer, cfg.tokenizer or cfg.path,
                             trust_remote_code=args.trust_remote_code)


def _no_tokenizer() -> None:
    return None


def load_engine_tokenizer(args: EngineArgs, cfg: ModelConfig):
    """The tokenizer the front end uses (None with skip_tokenizer_init)."""
    if args.skip_tokenizer_init:
        return None
    from ember.tokenizer import load_tokenizer

    return load_tokenizer(cfg.tokenizer or cfg.path, trust_remote_code=args.trust_remote_code)
