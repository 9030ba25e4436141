"""UniProcExecutor: resolves platform, model and attention backend, and runs the model
runner in this process. The KV cache is sized here from the memory budget."""

from __future__ import annotations

import logging

from ember.config import EngineArgs, resolve_model_config
from ember.core.scheduler_output import SchedulerOutput

logger = logging.getLogger("ember")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
MAX_GRAPH_BATCH_SIZE = 512


class UniProcExecutor:
    def __init__(self, args: EngineArgs) -> None:
        import torch

        from ember.attention_backends.selector import select_attention_backend
        from ember.platforms import resolve_platform
        from ember.plugins import load_plugins
        from ember.worker.model_runner import ModelRunner

        load_plugins()
        self.platform = resolve_platform(args.device)
        self.platform.seed_everything(args.seed)
        self.model_config = resolve_model_config(args, self.platform)
        hf = self.model_config.hf_config
        head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.attn_backend = select_attention_backend(
            self.platform,
            dtype=self.model_config.dtype,
            head_size=head_size,
            sliding_window=bool(getattr(hf, "sliding_window", None)),
            override=args.attention_backend,
        )
        self.runner = ModelRunner(
            self.model_config,
            self.attn_backend,
            torch.device(self.platform.device()),
            args.block_size,
            show_progress=args.show_progress,
        )
        self.runner.load_model()
        self.max_num_batched_tokens = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.peak_activation_bytes = 0
        if self.platform.device_type == "cuda":
            self._profile(args)
        self.num_blocks = self._num_blocks(args)
        self.runner.initialize_kv_cache(self.num_blocks)
        self.graph_capture_seconds = 0.0
        if (
            self.platform.device_type == "cuda"
            and not args.enforce_eager
            and self.attn_backend.supports_cuda_graphs
        ):
            self.graph_capture_seconds = self.runner.capture_cuda_graphs(
                min(args.max_num_seqs, MAX_GRAPH_BATCH_SIZE)
            )
        if args.compile_model:
            # After graph capture: decode graphs hold the eager kernels (fused ones on CUDA);
            # the compiled model serves the steps that run eagerly (prefill, mixed, large).
            self.runner.compile_model()

    def _profile(self, args: EngineArgs) -> None:
        """Measure the peak memory of the largest step before the KV cache takes the rest."""
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.runner.profile_run(self.max_num_batched_tokens, args.max_num_seqs)
        torch.cuda.synchronize()
        self.peak_activation_bytes = torch.cuda.max_memory_allocated() - before
        torch.cuda.empty_cache()

    def _num_blocks(self, args: EngineArgs) -> int:
        if args.num_gpu_blocks_override is not None:
            return args.num_gpu_blocks_override
        budget = args.kv_cache_memory_bytes
        if budget is None:
            budget = self.platform.kv_cache_memory_bytes(args.gpu_memory_utilization)
            budget -= self.peak_activation_bytes  # the largest step must still fit beside it
        num_blocks = int(budget // self.runner.bytes_per_block())
        # More blocks than max_num_seqs full-length requests can ever use is wasted memory.
        per_request = -(-self.model_config.max_model_len // args.block_size)
        return max(min(num_blocks, per_request * args.max_num_seqs), 0)

    def launch(self, scheduler_output: SchedulerOutput):
        """Start a step without waiting; `.resolve()` on the result gives its ModelRunnerOutput."""
        return self.runner.launch(scheduler_output)
