"""EngineArgs (what a user sets) and the resolved configs the engine runs with."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                  "bf16": "bfloat16"}


@dataclass
class EngineArgs:
    """Every engine setting, with vLLM's names. `model=None` means the embedded default model."""

    model: str | None = None
    tokenizer: str | None = None
    # Hub names only (ember.models.loader.hub): a branch, tag or commit of the model / tokenizer
    # (tokenizer_revision defaults to revision), and the cache folder (None: HF_HUB_CACHE).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    dtype: str = "auto"
    seed: int | None = 0  # None: unseeded (vLLM's), random draws differ from run to run
    max_model_len: int | None = None
    # The most logprobs / prompt_logprobs a request may ask for (vLLM's; -1: the vocabulary).
    max_logprobs: int = 20
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    quantization: str | None = None
    device: str | None = None  # platform name; None = detect
    attention_backend: str | None = None
    block_size: int = 16
    # vLLM's: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (float8_e4m3fn with per-tensor
    # scales; the triton attention backend only).
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    # "fcfs", or "priority": lower `priority` first (ties by arrival), preempting lower ones.
    scheduling_policy: str = "fcfs"
    enforce_eager: bool = False
    compile_model: bool = False
    # Plan step N+1 while step N runs on the device; None = on for CUDA, off elsewhere.
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Batches in flight at once (vLLM's batch queue): None = pipeline_parallel_size, so every
    # stage has a batch to run; 1 runs one batch at a time (no overlap of the stages). Above 1
    # only with pipeline_parallel_size > 1.
    max_concurrent_batches: int | None = None
    # vLLM's: "uni" (in process), "mp" (a process per rank), "ray" (an actor per rank), or a
    # plugin's executor name; None = "uni" for one rank, "mp" for more.
    distributed_executor_backend: str | None = None
    disable_log_stats: bool = True
    show_progress: bool = True
    # A dict of config attributes (a dict for a sub-config updates it), or vLLM's callable
    # `f(config) -> config`; applied to config.json and GGUF metadata alike, before the build.
    hf_overrides: dict[str, Any] | Callable[[Any], Any] = field(default_factory=dict)
    # Default sampling values when no SamplingParams is given: "auto" = the model's own
    # (generation_config.json or GGUF metadata), "vllm" = SamplingParams' defaults, or a folder.
    generation_config: str = "auto"
    # vLLM's: LLM.sleep() / wake_up() are refused unless the engine was created with this.
    enable_sleep_mode: bool = False
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's StructuredOutputsConfig, as a dict ({"backend": "auto" | "xgrammar" | "guidance" |
    # a plugin's, "disable_any_whitespace": ..., ...}) or an
    # ember.structured_output.StructuredOutputsConfig.
    structured_outputs_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's: "auto" (pooling for encoder-only and *ForSequenceClassification architectures),
    # "generate", or "pooling" (embed / classify / score; ember.pooling).
    runner: str = "auto"
    # vLLM's: how runner="pooling" adapts a model: "auto", "none", "embed" (a decoder's last-token
    # embeddings), "classify" (a *ForSequenceClassification checkpoint); "reward" is refused.
    convert: str = "auto"
    # vLLM's deprecated `task` ("embed", "classify", "score", "generate", ...), mapped onto
    # runner / convert with a warning (ember.pooling.config).
    task: str | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def validate(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors, gguf or dummy, got {self.load_format!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or >= 0, got {self.max_logprobs!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(
                os.path.expanduser(self.generation_config)):
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder holding a "
                             f"generation_config.json, got {self.generation_config!r}")
        if not isinstance(self.override_generation_config, dict):
            raise ValueError("override_generation_config must be a dict, got "
                             f"{type(self.override_generation_config).__name__}")
        from ember.structured_output.config import StructuredOutputsConfig

        StructuredOutputsConfig.of(self.structured_outputs_config).validate()
        from ember.pooling.config import RUNNERS, check_task_and_convert

        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        check_task_and_convert(self.convert, self.task)
        self._validate_parallel()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}"
                             + (" (fp8_e5m2 is not supported)" if "e5m2" in self.kv_cache_dtype
                                else ""))
        if self.quantization not in (None, "gguf", "none"):
            from ember.registry import QuantizationRegistry

            if self.quantization not in QuantizationRegistry:
                raise ValueError(
                    f"unknown quantization method {self.quantization!r}; known: "
                    f"{', '.join(QuantizationRegistry.names())}, none (float weights)"
                )


    def _validate_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        batches = self.max_concurrent_batches
        if batches is not None and (not isinstance(batches, int) or isinstance(batches, bool)
                                    or batches < 1):
            raise ValueError(f"max_concurrent_batches must be an integer >= 1, got {batches!r}")
        if batches is not None and batches > 1 and self.pipeline_parallel_size == 1:
            raise ValueError(f"max_concurrent_batches={batches} needs pipeline_parallel_size > 1 "
                             "(several batches in flight keep pipeline stages busy)")
        backend = self.distributed_executor_backend
        if backend is not None:
            from ember.registry import ExecutorRegistry

            if not isinstance(backend, str) or backend not in ExecutorRegistry:
                raise ValueError(f"distributed_executor_backend must be one of "
                                 f"{', '.join(ExecutorRegistry.names())}, got {backend!r}")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if world > 1 and self.executor_backend() == "uni":
            raise ValueError(
                "distributed_executor_backend='uni' runs one rank in this process; "
                f"tensor_parallel_size x pipeline_parallel_size = {world} ranks need 'mp' or 'ray'")

    def concurrent_batches(self) -> int:
        """Batches the engine core keeps in flight (max_concurrent_batches resolved)."""
        if self.max_concurrent_batches is not None:
            return self.max_concurrent_batches
        return self.pipeline_parallel_size

    def executor_backend(self) -> str:
        """The executor registry name this engine runs on."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size * self.pipeline_parallel_size == 1 else "mp"


@dataclass
class ModelConfig:
    """The model as resolved from disk: where it is, its HF config, dtype and length limit."""

    path: str  # an HF directory or a .gguf file
    hf_config: PretrainedConfig
    architecture: str
    dtype: str
    max_model_len: int
    load_format: str
    is_gguf: bool
    tokenizer: str | None
    quantization: str | None = None  # the QuantizationRegistry name in use (None: float)
    # SamplingParams values the model asks for (EngineArgs.generation_config); empty: none.
    default_sampling: dict[str, Any] = field(default_factory=dict)
    max_logprobs: int = 20  # EngineArgs.max_logprobs
    # EngineArgs.structured_outputs_config, resolved (a StructuredOutputsConfig; None: defaults).
    structured_outputs: Any = None
    runner: str = "generate"  # "generate" | "pooling" (EngineArgs.runner, resolved)
    kv_cache_dtype: str = "auto"  # EngineArgs.kv_cache_dtype
    hub: Any = None  # an ember.models.loader.hub.HubModel when `model` was a hub name

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def eos_token_ids(self, tokenizer: Any = None) -> set[int]:
        """Every id that ends a sequence: the model config's eos ids and the tokenizer's."""
        ids: set[int] = set()
        for source in (self.hf_config, tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids
