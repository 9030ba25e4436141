"""LLM.get_metrics(): the engine's counters, gauges and histograms as plain objects (vLLM's).

vLLM's `LLM.get_metrics()` returns a list of `Counter`, `Gauge`, `Vector` and `Histogram`
objects read from its Prometheus registry; this gives the same shapes, with the names the
server's /metrics uses (an `ember:` prefix where vLLM has `vllm:`):

    ember:num_requests_running, ember:num_requests_waiting, ember:kv_cache_usage_perc   Gauge
    ember:prompt_tokens, ember:generation_tokens, ember:num_preemptions,
    ember:prefix_cache_queries, ember:prefix_cache_hits                                   Counter
    ember:request_success (label finished_reason)                                         Counter
    ember:time_to_first_token_seconds, ember:inter_token_latency_seconds,
    ember:e2e_request_latency_seconds, ember:request_prompt_tokens,
    ember:request_generation_tokens                                                       Histogram

Histogram buckets are cumulative counts keyed by their upper bound as a string ("+Inf" last),
as in Prometheus. `EngineStatsTracker` counts them from the engine core's outputs, so it sees
every token whatever the requests' output_kind (the offline LLM asks only for final outputs).
As in vLLM, the engine tracks them only with disable_log_stats=False.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from ember.core.messages import EngineCoreOutputs, SchedulerStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound -> observations <= it (cumulative), "+Inf" last


@dataclass
class _Hist:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def metric(self, name: str, labels: dict[str, str]) -> Histogram:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        cumulative, buckets = 0, {}
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts):
            cumulative += count
            buckets[bound] = cumulative
        return Histogram(name, dict(labels), self.n, self.total, buckets)


@dataclass
class _Live:
    prompt_len: int
    arrival: float
    last_token: float = 0.0
    generated: int = 0


class EngineStatsTracker:
    """Per-request latency and token accounting from core outputs (front end, one thread)."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.live: dict[str, _Live] = {}  # core request id ->
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}
        self.ttft = _Hist(TTFT_BUCKETS)
        self.itl = _Hist(ITL_BUCKETS)
        self.e2e = _Hist(E2E_BUCKETS)
        self.prompt_len = _Hist(TOKEN_BUCKETS)
        self.gen_len = _Hist(TOKEN_BUCKETS)
        self.scheduler_stats = SchedulerStats()
        self.new_prompt_tokens = 0  # since the stats logger last took them
        self.new_generation_tokens = 0

    def add(self, core_ids: list[str], prompt_len: int, arrival_time: float) -> None:
        for core_id in core_ids:
            self.live[core_id] = _Live(prompt_len, arrival_time)

    def record(self, outs: EngineCoreOutputs) -> None:
        if outs.scheduler_stats is not None:
            self.scheduler_stats = outs.scheduler_stats
        now = time.time()
        for out in outs.outputs:
            live = self.live.get(out.request_id)
            if live is None:
                continue
            if out.new_token_ids:
                if live.generated == 0:
                    self.prompt_tokens += live.prompt_len
                    self.new_prompt_tokens += live.prompt_len
                    self.ttft.observe(now - live.arrival)
                else:
                    self.itl.observe(now - live.last_token)
                live.generated += len(out.new_token_ids)
                live.last_token = now
                self.generation_tokens += len(out.new_token_ids)
                self.new_generation_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish([out.request_id], out.finish_reason, now)

    def finish(self, core_ids: list[str], reason: str, now: float | None = None) -> None:
        """Requests that ended (in the core, by a front-end stop string, or by abort)."""
        now = time.time() if now is None else now
        for core_id in core_ids:
            live = self.live.pop(core_id, None)
            if live is None:
                continue
            self.success[reason] = self.success.get(reason, 0) + 1
            self.e2e.observe(now - live.arrival)
            self.prompt_len.observe(live.prompt_len)
            self.gen_len.observe(live.generated)

    def take_new_tokens(self) -> tuple[int, int]:
        """(prompt, generation) tokens since the last call, for the stats logger."""
        taken = (self.new_prompt_tokens, self.new_generation_tokens)
        self.new_prompt_tokens = self.new_generation_tokens = 0
        return taken

    def metrics(self, sched: SchedulerStats | None = None) -> list[Metric]:
        sched = sched or self.scheduler_stats
        lab = self.labels
        out: list[Metric] = [
            Gauge("ember:num_requests_running", dict(lab), float(sched.num_running)),
            Gauge("ember:num_requests_waiting", dict(lab), float(sched.num_waiting)),
            Gauge("ember:kv_cache_usage_perc", dict(lab), float(sched.kv_cache_usage)),
            Counter("ember:prompt_tokens", dict(lab), self.prompt_tokens),
            Counter("ember:generation_tokens", dict(lab), self.generation_tokens),
            Counter("ember:num_preemptions", dict(lab), sched.num_preemptions),
            Counter("ember:prefix_cache_queries", dict(lab), sched.prefix_cache_queries),
            Counter("ember:prefix_cache_hits", dict(lab), sched.prefix_cache_hits),
        ]
        for reason in sorted({"stop", "length", "abort", *self.success}):
            out.append(Counter("ember:request_success", {**lab, "finished_reason": reason},
                               self.success.get(reason, 0)))
        out += [
            self.ttft.metric("ember:time_to_first_token_seconds", lab),
            self.itl.metric("ember:inter_token_latency_seconds", lab),
            self.e2e.metric("ember:e2e_request_latency_seconds", lab),
            self.prompt_len.metric("ember:request_prompt_tokens", lab),
            self.gen_len.metric("ember:request_generation_tokens", lab),
        ]
        return out
