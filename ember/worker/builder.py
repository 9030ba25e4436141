"""Builds a ready-to-run worker from EngineArgs: everything that happens once, before any step.

In order: plugins and the platform; the model config (ember.model_resolution.resolve_model_config); the model
class (the model registry's own resolution); the attention backend (by declared capability); the
weights (a loader chosen by format, ember.models.loader.formats); quantization; the activation
peak measured by the platform; the KV cache sized from what is left; decode graphs where platform
and backend both support them; torch.compile when asked; warm-up (ember.worker.warmup: dummy
steps at the engine's shapes, so nothing compiles in the first run). Each stage is timed
(ember.worker.startup_profile); the executor then only runs steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ember.attention_backends.base import AttentionBackend
    from ember.config import EngineArgs, ModelConfig
    from ember.platforms.base import Platform
    from ember.worker.model_runner import ModelRunner

logger = logging.getLogger("ember")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
MAX_GRAPH_BATCH_SIZE = 512


@dataclass
class BuiltWorker:
    """A model runner with its weights, KV cache and graphs in place, and how it was chosen."""

    platform: Platform
    model_config: ModelConfig
    attn_backend: type[AttentionBackend]
    runner: ModelRunner
    num_blocks: int
    max_num_batched_tokens: int
    peak_activation_bytes: int
    graph_capture_seconds: float
    # Seconds per start-up stage (ember.worker.startup_profile), and "total".
    startup_breakdown: dict[str, float] = field(default_factory=dict)


def head_size(model_config: ModelConfig) -> int:
    hf = model_config.hf_config
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def choose_attention_backend(platform: Platform, model_config: ModelConfig,
                             override: str | None) -> type[AttentionBackend]:
    from ember.attention_backends.selector import select_attention_backend

    return select_attention_backend(
        platform,
        dtype=model_config.dtype,
        head_size=head_size(model_config),
        sliding_window=bool(getattr(model_config.hf_config, "sliding_window", None)),
        override=override,
        kv_cache_dtype=model_config.kv_cache_dtype,
    )


def build_model(args: EngineArgs, platform: Platform, model_config: ModelConfig,
               attn_backend: type[AttentionBackend], dtype: torch.dtype) -> nn.Module:
    """The model class from the registry, built with the quantization method's linear layers
    (ember.quantization.base), its weights from the format's loader, then post-processed."""
    from ember.models.loader.formats import load_weights
    from ember.quantization import snapshot_cache
    from ember.quantization.base import (
        building_with,
        finish_loading,
        prepare_method,
        quantized_layers,
        weight_bytes,
    )
    from ember.registry import ModelRegistry

    model_cls, arch = ModelRegistry.resolve_model_cls(model_config.architecture)
    check_parallel_support(model_cls, arch, args)
    progress = None if args.show_progress else False
    method = prepare_method(model_config.quantization, model_config.path, model_config.hf_config,
                            platform.device_type, dtype)
    device = platform.device()
    with building_with(method):
        # A single-file checkpoint whose method cached its post-load work (the gguf method on
        # the CPU) skips reading, decoding and packing: ember.quantization.snapshot_cache.
        model = snapshot_cache.load(model_config, method, model_cls, attn_backend, dtype, device)
        restored = model is not None
        if model is None:
            model = load_weights(model_config, model_cls, attn_backend, dtype, device, progress)
    if restored:
        count, nbytes = quantized_layers(model), weight_bytes(model)
    else:
        count, nbytes = finish_loading(model, method)
        snapshot_cache.save(model_config, method, model, model_cls, dtype, device)
    how = f"{model_config.quantization}, {count} linear layers" if method else "unquantized"
    logger.info("model weights take %.1f MiB (%s)", nbytes / 2**20, how)
    return model


def check_parallel_support(model_cls: type, arch: str, args: EngineArgs) -> None:
    """Tensor / pipeline parallelism need a model built for it (a class attribute says so)."""
    for size_name, flag in (("tensor_parallel_size", "supports_tensor_parallel"),
                            ("pipeline_parallel_size", "supports_pipeline_parallel")):
        size = getattr(args, size_name)
        if size > 1 and not getattr(model_cls, flag, False):
            raise ValueError(f"{size_name}={size}: architecture {arch} does not support it "
                             f"({model_cls.__name__}.{flag} is False)")


def kv_cache_num_blocks(args: EngineArgs, platform: Platform, runner: ModelRunner,
                        peak_activation_bytes: int) -> int:
    """Blocks for the explicit override, else for the byte budget (given, or the platform's
    less the activation peak), capped at what max_num_seqs full-length requests can use."""
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    budget = args.kv_cache_memory_bytes
    if budget is None:
        budget = platform.kv_cache_memory_bytes(args.gpu_memory_utilization)
        budget -= peak_activation_bytes  # the largest step must still fit beside it
    num_blocks = int(budget // runner.bytes_per_block())
    per_request = -(-runner.model_config.max_model_len // args.block_size)
    return max(min(num_blocks, per_request * args.max_num_seqs), 0)


def captures_graphs(args: EngineArgs, platform: Platform,
                    attn_backend: type[AttentionBackend]) -> bool:
    """Decode graphs need a platform that captures them and a graph-safe backend."""
    # Pipeline stages exchange activations with point-to-point sends, kept out of graphs. On the
    # host a compiled model serves every step (its warm-up compiles the one-token graph too,
    # which decode graphs would leave to the first one-token prompt).
    if args.compile_model and platform.device_is_host():
        return False
    return (not args.enforce_eager and platform.supports_cuda_graphs
            and (attn_backend.supports_cuda_graphs or platform.graph_capture_checks_work)
            and args.pipeline_parallel_size == 1)


def build_worker(args: EngineArgs) -> BuiltWorker:
    """Resolve, load, size, capture and warm up (see the module docstring for the order)."""
    from ember.worker.startup_profile import StartupProfile

    profile = StartupProfile()
    with profile.stage("imports"):
        # The first import of torch is most of this stage; without this line it would land in
        # whichever stage first needed it. (transformers is imported by the config stage when a
        # directory's config.json needs it; a GGUF file's config does not.)
        import torch  # noqa: F401

        from ember.distributed.parallel_state import agree_min, get_world_size
        from ember.model_resolution import resolve_model_config
        from ember.platforms import resolve_platform
        from ember.plugins import load_plugins
        from ember.worker.model_runner import ModelRunner, torch_dtype
        from ember.worker.warmup import run_warmup
    with profile.stage("plugins"):
        load_plugins()
    with profile.stage("platform"):
        platform = resolve_platform(args.device)
        if args.seed is None:
            torch.seed()  # vLLM's seed=None: nondeterministic, from the OS's entropy
        else:
            platform.seed_everything(args.seed)
    with profile.stage("config"):
        model_config = resolve_model_config(args, platform)
        attn_backend = choose_attention_backend(platform, model_config, args.attention_backend)
    dtype = torch_dtype(model_config.dtype)
    with profile.stage("weights"):
        model = build_model(args, platform, model_config, attn_backend, dtype)
        runner_cls = ModelRunner
        if get_world_size() > 1:
            from ember.worker.parallel_runner import ParallelModelRunner as runner_cls
        runner = runner_cls(model_config, attn_backend, platform, model, args.block_size)
    max_tokens = (args.max_num_batched_tokens or platform.default_max_num_batched_tokens
                  or DEFAULT_MAX_NUM_BATCHED_TOKENS)
    with profile.stage("memory_profile"):
        peak = platform.profile_peak_memory(
            lambda: runner.profile_run(max_tokens, args.max_num_seqs))
    with profile.stage("kv_cache"):
        # Every rank holds the same blocks (the scheduler's block ids index each rank's cache).
        num_blocks = agree_min(kv_cache_num_blocks(args, platform, runner, peak))
        runner.initialize_kv_cache(num_blocks)
    capture_seconds = 0.0
    if captures_graphs(args, platform, attn_backend):
        with profile.stage("graph_capture"):
            capture_seconds = runner.capture_graphs(min(
                args.max_num_seqs, platform.max_graph_batch_size or MAX_GRAPH_BATCH_SIZE,
                MAX_GRAPH_BATCH_SIZE))
    if args.compile_model:
        # After graph capture: decode graphs hold the eager kernels (fused ones on CUDA);
        # the compiled model serves the steps that run eagerly (prefill, mixed, large).
        # Wrapping is quick: inductor compiles at the first calls, i.e. in the warm-up.
        with profile.stage("compile"):
            runner.compile_model()
    # Last, so the steps it runs see the model the engine will run (graphs replayed, the
    # compiled model traced) and everything they compile is what the engine's steps use.
    with profile.stage("warmup"):
        run_warmup(runner, num_blocks, max_tokens, args.max_num_seqs)
    if args.compile_model and platform.device_is_host():
        # The host's warm-up traced both graphs (one token, and any other count: dynamic), so
        # the steps to come need no new compilation (tests/test_compile_model.py checks). Not
        # on a GPU: there one-token steps replay CUDA graphs in the warm-up, so an eager
        # one-token step (a one-token prompt) may still need its graph compiled.
        runner.skip_guards = True
    return BuiltWorker(platform, model_config, attn_backend, runner, num_blocks, max_tokens,
                       peak, capture_seconds, profile.breakdown())
