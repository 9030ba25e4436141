"""Periodic stats log lines, vLLM's (`disable_log_stats=False`).

Every EMBER_LOG_STATS_INTERVAL seconds (10 by default, as vLLM's VLLM_LOG_STATS_INTERVAL) a
line gives the prompt and generation throughput since the last line, the running and waiting
requests, the KV cache usage and the prefix-cache hit rate since the last line:

    Avg prompt throughput: 120.0 tokens/s, Avg generation throughput: 45.3 tokens/s, Running: 3
    reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

An idle engine logs one line with zeros, then stays quiet (at DEBUG) until work comes back.
LLMEngine feeds it from its step loop, AsyncLLM from its output thread.
"""

from __future__ import annotations

import logging
import threading
import time

from ember.core.messages import SchedulerStats

logger = logging.getLogger("ember")


class LoggingStatLogger:
    """Counts tokens as batches come in (`record`) and logs when the interval has passed."""

    def __init__(self, interval: float | None = None) -> None:
        from ember import envs

        self.interval = envs.log_stats_interval() if interval is None else interval
        self._lock = threading.Lock()  # AsyncLLM records from its output thread and its callers
        self.last_log = time.monotonic()
        self.prompt_tokens = 0  # since the last line
        self.generation_tokens = 0
        self._last_queries = 0
        self._last_hits = 0
        self._last_was_idle = False

    def record(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens
            self.generation_tokens += num_generation_tokens

    def record_iteration(self, stats) -> None:
        """AsyncLLM's stat-logger hook: an IterationStats."""
        self.record(stats.num_prompt_tokens, stats.num_generation_tokens)

    def maybe_log(self, sched: SchedulerStats | None, now: float | None = None) -> bool:
        """Log a line if the interval has passed; returns whether it did."""
        now = time.monotonic() if now is None else now
        if now - self.last_log < self.interval:
            return False
        self.log(sched or SchedulerStats(), now)
        return True

    def log(self, sched: SchedulerStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            elapsed = max(now - self.last_log, 1e-9)
            prompt, generation = self.prompt_tokens, self.generation_tokens
            self.prompt_tokens = self.generation_tokens = 0
            self.last_log = now
        queries = sched.prefix_cache_queries - self._last_queries
        hits = sched.prefix_cache_hits - self._last_hits
        self._last_queries, self._last_hits = sched.prefix_cache_queries, sched.prefix_cache_hits
        idle = not (prompt or generation or sched.num_running or sched.num_waiting)
        log = logger.debug if idle and self._last_was_idle else logger.info
        self._last_was_idle = idle
        log("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            prompt / elapsed, generation / elapsed, sched.num_running, sched.num_waiting,
            100.0 * sched.kv_cache_usage, 100.0 * hits / queries if queries > 0 else 0.0)
