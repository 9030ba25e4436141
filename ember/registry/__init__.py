"""The registries (models, attention backends, quantization methods, platforms, executors,
logits processors, grammar backends, tool-call parsers, reasoning parsers, poolers), their built-in
entries, and the snapshot/restore hand-off to worker processes.

Importing this package imports no model, backend, platform, executor or plugin code, and it
imports nothing of ember.plugins: the plugin loader registers into ember.registry.hooks (when
`import ember` imports it), so the first lookup or registration loads the installed plugins once,
plugin entries are there whenever anything is read, and user registrations come after plugins'.

Worker processes: `snapshot()` in the parent gives a plain dict (JSON- and pickle-safe) of every
entry, including classes registered as objects (recorded as "module:qualname"); `restore(snap)` in
the worker installs that table and marks plugins as loaded, so workers never rediscover plugins.
A class defined inside a function, or in an interactive `__main__` (REPL, notebook, `python -c`),
cannot be imported by another process: its entry is marked in the snapshot and resolving it in
the worker raises an ImportError saying why. A class defined at module level of a main script does
work with multiprocessing's spawn start method (which re-imports the script as `__mp_main__`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ember.registry import hooks
from ember.registry.base import Entry, LazyRegistry, registering_as
from ember.registry.capabilities import backend_caps, check_class_attributes

SNAPSHOT_FORMAT = 1


class ModelRegistryType(LazyRegistry[type]):
    """HF architecture name (config.json "architectures") -> model class."""

    def register_model(self, arch: str, model_cls: str | type, *, override: bool = False,
                       **capabilities: Any) -> Entry:
        """Register a model class, or its "module:Class" path (preferred: nothing is imported)."""
        return self.register(arch, model_cls, capabilities=capabilities, override=override)

    def get_supported_archs(self) -> list[str]:
        return self.names()

    def resolve_architecture(self, architectures: str | list[str]) -> str:
        """The first registered architecture of ``architectures`` (nothing is imported)."""
        archs = [architectures] if isinstance(architectures, str) else list(architectures)
        arch = next((a for a in archs if a in self), None)
        if arch is None:
            raise ValueError(
                f"model architecture {archs or '(none given in config)'} is not supported; "
                f"known architectures: {', '.join(self.get_supported_archs())}"
            )
        return arch

    def resolve_model_cls(self, architectures: str | list[str]) -> tuple[type, str]:
        """The first registered architecture of ``architectures``, and its class."""
        arch = self.resolve_architecture(architectures)
        return self.resolve(arch), arch


class AttentionBackendRegistryType(LazyRegistry[type]):
    """Backend name -> AttentionBackend subclass, with the capabilities selection reads."""

    def normalize_capabilities(self, caps: dict[str, Any]) -> dict[str, Any]:
        return backend_caps(caps)

    def check_resolved(self, entry: Entry, obj: Any) -> None:
        # `cuda_graphs` is declared here; the class's `supports_cuda_graphs` must agree.
        check_class_attributes(self.kind, entry.name, entry.target, entry.capabilities, obj)

    def register_backend(
        self,
        name: str,
        backend_cls: str | type,
        *,
        devices: list[str],
        dtypes: list[str],
        head_sizes: str | list[int] = "any",
        sliding_window: bool = False,
        cuda_graphs: bool = False,
        priority: int = 0,
        requires: list[str] | None = None,
        env_devices: dict[str, list[str]] | None = None,
        kv_cache_dtypes: list[str] | None = None,
        override: bool = False,
    ) -> Entry:
        caps = {"devices": list(devices), "dtypes": list(dtypes), "head_sizes": head_sizes,
                "sliding_window": sliding_window, "cuda_graphs": cuda_graphs,
                "priority": priority, "requires": list(requires or []),
                "env_devices": dict(env_devices or {}),
                "kv_cache_dtypes": list(kv_cache_dtypes or ["auto"])}
        return self.register(name, backend_cls, capabilities=caps, override=override)

    def get_supported_backends(self) -> list[str]:
        return self.names()


class QuantizationRegistryType(LazyRegistry[type]):
    """Quantization method name (vLLM's `quantization=` values) -> method class.

    Capabilities (defaults filled in): "platforms" (device types), "dtypes", "layer_kinds",
    "checkpoint_formats" (checkpoint metadata the method reads: "gguf" or an HF
    quantization_config quant_method; empty = it quantizes float weights after loading) and
    "quantizes_float" (it can also quantize a float checkpoint). Selection reads them without
    importing the method (ember.quantization.base.resolve_quantization)."""

    def normalize_capabilities(self, caps: dict[str, Any]) -> dict[str, Any]:
        out = dict(caps)
        out.setdefault("platforms", ["cpu", "cuda"])
        out.setdefault("dtypes", ["float32", "float16", "bfloat16"])
        out.setdefault("layer_kinds", ["linear"])
        out.setdefault("checkpoint_formats", [])
        out.setdefault("quantizes_float", not out["checkpoint_formats"])
        for key in ("platforms", "dtypes", "layer_kinds", "checkpoint_formats"):
            if isinstance(out[key], str) or not all(isinstance(v, str) for v in out[key]):
                raise ValueError(f"quantization capability {key!r} must be a list of names, "
                                 f"got {out[key]!r}")
            out[key] = list(out[key])
        return out

    def register_quantization_method(self, name: str, method_cls: str | type, *,
                                     override: bool = False, **capabilities: Any) -> Entry:
        return self.register(name, method_cls, capabilities=capabilities, override=override)

    def get_supported_quantization_methods(self) -> list[str]:
        return self.names()


class PlatformRegistryType(LazyRegistry[type]):
    """Platform name (what `device=` takes) -> Platform subclass.

    Capability "probe": an optional "module:function" returning bool, so availability can be
    checked without importing the platform class's module.
    """

    def normalize_capabilities(self, caps: dict[str, Any]) -> dict[str, Any]:
        probe = caps.get("probe")
        if probe is not None and (not isinstance(probe, str) or ":" not in probe):
            raise ValueError(f"'probe' must be a 'module:function' string, got {probe!r}")
        return caps

    def check_resolved(self, entry: Entry, obj: Any) -> None:
        # A registered `device_type` is the truth; the class's `device_type` must agree.
        check_class_attributes(self.kind, entry.name, entry.target, entry.capabilities, obj)

    def register_platform(self, name: str, platform_cls: str | type, *, probe: str | None = None,
                          override: bool = False, **capabilities: Any) -> Entry:
        if probe is not None:
            capabilities["probe"] = probe
        return self.register(name, platform_cls, capabilities=capabilities, override=override)

    def get_supported_platforms(self) -> list[str]:
        return self.names()


class ExecutorRegistryType(LazyRegistry[type]):
    """Executor name -> executor class: what runs the model for the engine core ("uni": in this
    process). The engine core builds its executor through this registry, never by importing one;
    plugins add executors with the ``ember_register_executors`` hook."""

    def register_executor(self, name: str, executor_cls: str | type, *, override: bool = False,
                          **capabilities: Any) -> Entry:
        return self.register(name, executor_cls, capabilities=capabilities, override=override)

    def get_supported_executors(self) -> list[str]:
        return self.names()


class LogitsProcessorRegistryType(LazyRegistry[type]):
    """Logits processor name -> ember.logits_processors.LogitsProcessor subclass.

    The built-ins (min_tokens, logit_bias, allowed_token_ids, bad_words, min_p) are driven by
    their own SamplingParams fields; any other name is selected per request by
    ``SamplingParams(extra_args={name: args})``. A plugin may replace a built-in with
    ``override=True`` (the engine resolves the built-in names through this registry too)."""

    def register_logits_processor(self, name: str, processor_cls: str | type, *,
                                  override: bool = False, **capabilities: Any) -> Entry:
        return self.register(name, processor_cls, capabilities=capabilities, override=override)

    def get_supported_logits_processors(self) -> list[str]:
        return self.names()


class GrammarBackendRegistryType(LazyRegistry[type]):
    """Grammar backend name -> ember.structured_output.interface.StructuredOutputBackend subclass
    (structured outputs: `xgrammar`, the default, and `guidance` built in). The engine picks one
    with EngineArgs.structured_outputs_config={"backend": name} ("auto": xgrammar, else
    guidance)."""

    def register_grammar_backend(self, name: str, backend_cls: str | type, *,
                                 override: bool = False, **capabilities: Any) -> Entry:
        return self.register(name, backend_cls, capabilities=capabilities, override=override)

    def get_supported_grammar_backends(self) -> list[str]:
        return self.names()


class ToolParserRegistryType(LazyRegistry[type]):
    """Tool-call parser name (vLLM's ``--tool-call-parser`` values) ->
    ember.tool_parsers.ToolParser subclass: `hermes`, `llama3_json`, `mistral` built in."""

    def register_tool_parser(self, name: str, parser_cls: str | type, *, override: bool = False,
                             **capabilities: Any) -> Entry:
        return self.register(name, parser_cls, capabilities=capabilities, override=override)

    def get_supported_tool_parsers(self) -> list[str]:
        return self.names()


class ReasoningParserRegistryType(LazyRegistry[type]):
    """Reasoning parser name (vLLM's ``--reasoning-parser`` values) ->
    ember.reasoning.ReasoningParser subclass: `qwen3`, `deepseek_r1` built in."""

    def register_reasoning_parser(self, name: str, parser_cls: str | type, *,
                                  override: bool = False, **capabilities: Any) -> Entry:
        return self.register(name, parser_cls, capabilities=capabilities, override=override)

    def get_supported_reasoning_parsers(self) -> list[str]:
        return self.names()


class PoolerRegistryType(LazyRegistry[Any]):
    """Pooling mode name (sentence-transformers' and vLLM's: `cls`, `mean`, `last`) -> a
    function `(hidden [T, H], PoolingBatch) -> [B, H]` (ember.pooling.poolers)."""

    def register_pooler(self, name: str, pooler: str | Any, *, override: bool = False,
                        **capabilities: Any) -> Entry:
        return self.register(name, pooler, capabilities=capabilities, override=override)

    def get_supported_poolers(self) -> list[str]:
        return self.names()


ModelRegistry = ModelRegistryType("model architecture")
AttentionBackendRegistry = AttentionBackendRegistryType("attention backend")
QuantizationRegistry = QuantizationRegistryType("quantization method")
PlatformRegistry = PlatformRegistryType("platform")
ExecutorRegistry = ExecutorRegistryType("executor")
LogitsProcessorRegistry = LogitsProcessorRegistryType("logits processor")
GrammarBackendRegistry = GrammarBackendRegistryType("grammar backend")
ToolParserRegistry = ToolParserRegistryType("tool-call parser")
ReasoningParserRegistry = ReasoningParserRegistryType("reasoning parser")
PoolerRegistry = PoolerRegistryType("pooler")

REGISTRIES: dict[str, LazyRegistry] = {
    "models": ModelRegistry,
    "attention_backends": AttentionBackendRegistry,
    "quantization_methods": QuantizationRegistry,
    "platforms": PlatformRegistry,
    "executors": ExecutorRegistry,
    "logits_processors": LogitsProcessorRegistry,
    "grammar_backends": GrammarBackendRegistry,
    "tool_parsers": ToolParserRegistry,
    "reasoning_parsers": ReasoningParserRegistry,
    "poolers": PoolerRegistry,
}

_BUILTIN_MODELS = {
    "LlamaForCausalLM": "ember.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "ember.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "ember.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "ember.models.qwen3:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "ember.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "ember.models.gemma3:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "ember.models.phi3:Phi3ForCausalLM",
    "Qwen3MoeForCausalLM": "ember.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "ember.models.mixtral:MixtralForCausalLM",
}
# Pooling models (ember.pooling): capability runner="pooling" makes runner="auto" pick pooling.
_BUILTIN_POOLING_MODELS = {
    "BertModel": "ember.models.bert:BertModel",
    "BertForSequenceClassification": "ember.models.bert:BertForSequenceClassification",
    "LlamaForSequenceClassification":
        "ember.models.pooling_decoders:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification":
        "ember.models.pooling_decoders:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification":
        "ember.models.pooling_decoders:Qwen3ForSequenceClassification",
}
_BUILTIN_POOLERS = {
    "cls": "ember.pooling.poolers:cls_pool",
    "mean": "ember.pooling.poolers:mean_pool",
    "last": "ember.pooling.poolers:last_pool",
}
_HALF = ["float16", "bfloat16"]
_ALL = ["float32", "float16", "bfloat16"]
_BUILTIN_BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    # The reference: any head size, any dtype, everywhere; last resort in every preference list.
    "sdpa": ("ember.attention_backends.sdpa:SdpaBackend",
             {"devices": ["cpu", "cuda"], "dtypes": _ALL, "head_sizes": "any",
              "sliding_window": True, "cuda_graphs": False, "priority": 0}),
    # On the CPU only under the Triton interpreter (CI runs the kernels that way).
    "triton": ("ember.attention_backends.triton_backend:TritonBackend",
               {"devices": ["cuda"], "dtypes": _ALL, "head_sizes": [16, 32, 64, 128, 256],
                "sliding_window": True, "cuda_graphs": True, "priority": 10,
                "requires": ["triton"], "env_devices": {"TRITON_INTERPRET=1": ["cpu"]},
                "kv_cache_dtypes": ["auto", "fp8", "fp8_e4m3"]}),
    "flashinfer": ("ember.attention_backends.flashinfer_backend:FlashInferBackend",
                   {"devices": ["cuda"], "dtypes": _HALF, "head_sizes": [64, 128, 256],
                    "sliding_window": True, "cuda_graphs": False, "priority": 20,
                    "requires": ["flashinfer", "triton"]}),  # its KV store is ours
}
_BUILTIN_QUANTIZATION: dict[str, tuple[str, dict[str, Any]]] = {
    "int8": ("ember.quantization.int8:Int8WeightOnly", {}),
    "gguf": ("ember.quantization.gguf:GGUFQuantization",
             {"checkpoint_formats": ["gguf"], "quantizes_float": False}),
    # 4-bit checkpoints: Triton kernels on CUDA, torch (dequantize per call) on the CPU.
    "awq": ("ember.quantization.awq:AWQQuantization",
            {"platforms": ["cpu", "cuda"], "checkpoint_formats": ["awq"],
             "quantizes_float": False}),
    "gptq": ("ember.quantization.gptq:GPTQQuantization",
             {"platforms": ["cpu", "cuda"], "checkpoint_formats": ["gptq"],
              "quantizes_float": False}),
    # W8A8 through torch._scaled_mm: fp8 checkpoints, or float ones quantized at load.
    "fp8": ("ember.quantization.fp8:Fp8Quantization",
            {"platforms": ["cuda"], "dtypes": ["float16", "bfloat16"],
             "checkpoint_formats": ["fp8", "compressed-tensors"], "quantizes_float": True}),
}
_BUILTIN_PLATFORMS = {
    "cpu": ("ember.platforms.cpu:CpuPlatform", {"device_type": "cpu"}),
    "cuda": ("ember.platforms.cuda:CudaPlatform",
             {"device_type": "cuda", "probe": "ember.platforms.cuda:cuda_probe"}),
    "rocm": ("ember.platforms.rocm:RocmPlatform",
             {"device_type": "cuda", "probe": "ember.platforms.rocm:rocm_probe"}),
}
_BUILTIN_EXECUTORS = {
    "uni": "ember.executor.uniproc:UniProcExecutor",
    "mp": "ember.executor.multiproc:MultiprocExecutor",
    "ray": "ember.executor.ray_executor:RayExecutor",
}
# In the order the sampler applies them (vLLM v1's); ember.logits_processors.BUILTIN repeats it.
_BUILTIN_LOGITS_PROCESSORS = {
    "allowed_token_ids": "AllowedTokenIdsLogitsProcessor",
    "bad_words": "BadWordsLogitsProcessor",
    "min_tokens": "MinTokensLogitsProcessor",
    "logit_bias": "LogitBiasLogitsProcessor",
    "min_p": "MinPLogitsProcessor",
}
_BUILTIN_GRAMMAR_BACKENDS = {
    "xgrammar": "ember.structured_output.xgrammar_backend:XgrammarBackend",
    "guidance": "ember.structured_output.guidance_backend:GuidanceBackend",
}

for _name, _target in _BUILTIN_MODELS.items():
    ModelRegistry.register(_name, _target, owner="ember")
# Multimodal checkpoints run as text only: ember.config builds them from config.text_config.
ModelRegistry.register("Gemma3ForConditionalGeneration",
                       "ember.models.gemma3:Gemma3ForConditionalGeneration", owner="ember",
                       capabilities={"text_config": True})
for _name, _target in _BUILTIN_POOLING_MODELS.items():
    ModelRegistry.register(_name, _target, owner="ember", capabilities={"runner": "pooling"})
for _name, _target in _BUILTIN_POOLERS.items():
    PoolerRegistry.register(_name, _target, owner="ember")
for _name, (_target, _caps) in _BUILTIN_BACKENDS.items():
    AttentionBackendRegistry.register(_name, _target, owner="ember", capabilities=_caps)
for _name, (_target, _caps) in _BUILTIN_QUANTIZATION.items():
    QuantizationRegistry.register(_name, _target, owner="ember", capabilities=_caps)
for _name, (_target, _caps) in _BUILTIN_PLATFORMS.items():
    PlatformRegistry.register(_name, _target, owner="ember", capabilities=_caps)
for _name, _target in _BUILTIN_EXECUTORS.items():
    ExecutorRegistry.register(_name, _target, owner="ember")
for _name in _BUILTIN_LOGITS_PROCESSORS:
    LogitsProcessorRegistry.register(
        _name, f"ember.logits_processors.builtin:{_BUILTIN_LOGITS_PROCESSORS[_name]}", owner="ember")
_BUILTIN_TOOL_PARSERS = {
    "hermes": "ember.tool_parsers.builtin:HermesToolParser",
    "llama3_json": "ember.tool_parsers.builtin:Llama3JsonToolParser",
    "mistral": "ember.tool_parsers.builtin:MistralToolParser",
}
_BUILTIN_REASONING_PARSERS = {
    "qwen3": "ember.reasoning.builtin:Qwen3ReasoningParser",
    "deepseek_r1": "ember.reasoning.builtin:DeepSeekR1ReasoningParser",
}

for _name, _target in _BUILTIN_GRAMMAR_BACKENDS.items():
    GrammarBackendRegistry.register(_name, _target, owner="ember")
for _name, _target in _BUILTIN_TOOL_PARSERS.items():
    ToolParserRegistry.register(_name, _target, owner="ember")
for _name, _target in _BUILTIN_REASONING_PARSERS.items():
    ReasoningParserRegistry.register(_name, _target, owner="ember")


def snapshot() -> dict[str, Any]:
    """Every registry's entries plus the hooks' sections (the plugin report, under "plugins"),
    as plain data for a worker process."""
    hooks.run_before_read()
    return {
        "format": SNAPSHOT_FORMAT,
        "registries": {kind: reg.export_entries() for kind, reg in REGISTRIES.items()},
        **hooks.export_sections(),
    }


def restore(snap: dict[str, Any]) -> None:
    """Install a parent's snapshot in this process; plugins are not rediscovered here."""
    if snap.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"registry snapshot format {snap.get('format')!r} is not "
                         f"{SNAPSHOT_FORMAT}; parent and worker run different ember versions?")
    hooks.adopt_sections(snap)
    for kind, reg in REGISTRIES.items():
        if kind in snap["registries"]:
            reg.import_entries(snap["registries"][kind])


def save_state() -> dict[str, Any]:
    """The registries' in-process state (entries and imported objects), for rollback/tests."""
    return {kind: reg._save() for kind, reg in REGISTRIES.items()}


def load_state(state: dict[str, Any]) -> None:
    for kind, reg in REGISTRIES.items():
        reg._load(state[kind])


@contextmanager
def isolated() -> Iterator[None]:
    """Registrations made inside the block are undone at its end (for tests)."""
    hooks.run_before_read()  # else plugin entries loaded inside the block would be undone too
    state = save_state()
    try:
        yield
    finally:
        load_state(state)


__all__ = [
    "Entry",
    "LazyRegistry",
    "ModelRegistry",
    "AttentionBackendRegistry",
    "QuantizationRegistry",
    "PlatformRegistry",
    "ExecutorRegistry",
    "LogitsProcessorRegistry",
    "GrammarBackendRegistry",
    "ToolParserRegistry",
    "ReasoningParserRegistry",
    "PoolerRegistry",
    "REGISTRIES",
    "registering_as",
    "snapshot",
    "restore",
    "isolated",
]
