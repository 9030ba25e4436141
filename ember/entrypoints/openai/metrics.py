"""Prometheus metrics of one server, with vLLM's names under an `ember:` prefix.

Each app has its own CollectorRegistry (two servers in one process, as in tests, never collide).
Counters and histograms are fed by the front end's IterationStats (prometheus-client is
thread-safe); gauges read the engine core's latest scheduler stats when scraped.

With `--api-server-count N` every HTTP process counts only its own requests, so counters and
histograms use prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the
launcher before the processes start) and a scrape of any process sums all of them; the gauges
describe the one engine core, which every process hears from, so they are reported as they are.
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 - re-exported
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ember.engine.async_llm import AsyncLLM, IterationStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


_GAUGES = (
    ("ember:num_requests_running", "Requests in the running batch.", "num_running"),
    ("ember:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("ember:kv_cache_usage_perc", "KV cache usage (1 = every block in use).", "kv_cache_usage"),
)


class _CoreGauges(Collector):
    """The engine core's scheduler numbers, read when scraped. A collector, not Gauge objects:
    in multiprocess mode those would be written to the shared files once per process."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats()
        for name, doc, key in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(stats.get(key, 0.0)))
            yield family


class ServerMetrics:
    """The metrics of one served model; `record` is the engine's stat logger."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        self.gauges = CollectorRegistry()
        self.gauges.register(_CoreGauges(engine, model_name))
        # In multiprocess mode the values live in shared files: registering them here as well
        # would count this process twice.
        self.registry = CollectorRegistry() if self.multiprocess_dir is None else None
        reg, labels, model = self.registry, ["model_name"], [model_name]
        self.prompt_tokens = Counter("ember:prompt_tokens", "Prefilled prompt tokens.", labels,
                                     registry=reg).labels(*model)
        self.generation_tokens = Counter("ember:generation_tokens", "Generated tokens.", labels,
                                         registry=reg).labels(*model)
        success = Counter("ember:request_success", "Finished requests, by finish reason.",
                          labels + ["finished_reason"], registry=reg)
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._success_family = success
        self._model_name = model_name
        self.ttft = Histogram("ember:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=reg).labels(*model)
        self.itl = Histogram("ember:inter_token_latency_seconds", "Time between tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=reg).labels(*model)
        self.e2e = Histogram("ember:e2e_request_latency_seconds", "Request latency, end to end.",
                             labels, buckets=_E2E_BUCKETS, registry=reg).labels(*model)
        self.prompt_len = Histogram(
            "ember:request_prompt_tokens", "Prompt tokens per finished request.", labels,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000), registry=reg,
        ).labels(*model)
        self.gen_len = Histogram(
            "ember:request_generation_tokens", "Generated tokens per finished request.", labels,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000), registry=reg,
        ).labels(*model)

    def record(self, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens:
            self.ttft.observe(value)
        for value in stats.inter_token_latencies:
            self.itl.observe(value)
        for done in stats.finished:
            counter = self.success.get(done.finish_reason)
            if counter is None:
                counter = self._success_family.labels(self._model_name, done.finish_reason)
            counter.inc()
            self.e2e.observe(done.e2e_latency)
            self.prompt_len.observe(done.num_prompt_tokens)
            self.gen_len.observe(done.num_generation_tokens)

    def render(self) -> bytes:
        if self.registry is not None:
            return generate_latest(self.gauges) + generate_latest(self.registry)
        from prometheus_client import multiprocess

        shared = CollectorRegistry()
        multiprocess.MultiProcessCollector(shared, path=self.multiprocess_dir)
        return generate_latest(self.gauges) + generate_latest(shared)
