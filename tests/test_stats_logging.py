"""disable_log_stats=False: vLLM-style periodic log lines (throughput, running/waiting, KV cache
usage, prefix-cache hit rate) from LLMEngine (core in process and in its own) and AsyncLLM, with
EMBER_LOG_STATS_INTERVAL=0 so every step may log (no timing assertions). Also AsyncLLM's engine
control (reset_prefix_cache, sleep, wake_up, is_sleeping, collective_rpc)."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from model_factory import make_tiny_model

from ember import LLM, EngineArgs, SamplingParams
from ember.core.messages import SchedulerStats
from ember.engine.stat_logging import LoggingStatLogger

LINE = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: "
                  r"([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, "
                  r"KV cache usage: ([\d.]+)%, Prefix cache hit rate: ([\d.]+)%")
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
PROMPT = [3 + i for i in range(20)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("stats")))


def _num_layers(worker) -> int:  # module level: plain pickle carries it to the core
    return worker.model.num_layers


def _lines(caplog) -> list[re.Match]:
    return [m for r in caplog.records if (m := LINE.search(r.getMessage()))]


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "core_process"])
def test_llm_engine_logs_stats(tiny_path, monkeypatch, caplog, multiprocess):
    monkeypatch.setenv("EMBER_LOG_STATS_INTERVAL", "0")
    monkeypatch.setenv("EMBER_ENGINE_PROCESS", "1" if multiprocess else "0")
    llm = LLM(tiny_path, skip_tokenizer_init=True, max_model_len=128, block_size=4,
              num_gpu_blocks_override=64, disable_log_stats=False)
    try:
        with caplog.at_level(logging.INFO, logger="ember"):
            # The same prompt twice: the second run hits the prefix cache.
            for _ in range(2):
                llm.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)
        lines = _lines(caplog)
        assert lines, "no stats line was logged"
        assert sum(float(m.group(2)) for m in lines) > 0  # generation throughput was seen
        assert any(float(m.group(1)) > 0 for m in lines)  # and prompt throughput
        assert any(int(m.group(3)) == 1 for m in lines) or multiprocess  # running (in process)
        assert any(float(m.group(6)) > 0 for m in lines)  # the second run's prefix hits
    finally:
        llm.shutdown()


def test_default_logs_nothing(tiny_path, monkeypatch, caplog):
    monkeypatch.setenv("EMBER_LOG_STATS_INTERVAL", "0")
    llm = LLM(tiny_path, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=64)
    with caplog.at_level(logging.DEBUG, logger="ember"):
        llm.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)
    assert not _lines(caplog)  # vLLM's LLM default: disable_log_stats=True
    llm.shutdown()


def test_idle_engine_logs_one_line_then_quiets(caplog):
    stat_logger = LoggingStatLogger(interval=0.0)
    with caplog.at_level(logging.INFO, logger="ember"):
        stat_logger.record(10, 5)
        stat_logger.log(SchedulerStats(num_running=1, kv_cache_usage=0.25,
                                       prefix_cache_queries=8, prefix_cache_hits=4))
        for _ in range(3):  # idle from here on
            stat_logger.log(SchedulerStats(prefix_cache_queries=8, prefix_cache_hits=4))
    lines = _lines(caplog)
    assert len(lines) == 2  # the busy line and one idle line; the rest went to DEBUG
    first = lines[0]
    assert first.group(3) == "1" and first.group(5) == "25.0" and first.group(6) == "50.0"
    assert lines[1].group(1) == "0.0" and lines[1].group(6) == "0.0"


def test_log_interval_env_is_checked(monkeypatch):
    monkeypatch.setenv("EMBER_LOG_STATS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="EMBER_LOG_STATS_INTERVAL"):
        LoggingStatLogger()
    monkeypatch.setenv("EMBER_LOG_STATS_INTERVAL", "2.5")
    assert LoggingStatLogger().interval == 2.5


def test_async_llm_logs_stats_and_sleeps(tiny_path, monkeypatch, caplog):
    from ember.engine.async_llm import AsyncLLM

    monkeypatch.setenv("EMBER_LOG_STATS_INTERVAL", "0")
    engine = AsyncLLM(EngineArgs(model=tiny_path, skip_tokenizer_init=True, block_size=4,
                                 num_gpu_blocks_override=64, disable_log_stats=False,
                                 enable_sleep_mode=True))

    async def generate(request_id: str) -> list[int]:
        final = None
        async for out in engine.generate({"prompt_token_ids": PROMPT}, PARAMS, request_id):
            final = out
        return list(final.outputs[0].token_ids)

    async def run() -> None:
        before = await generate("a")
        assert await engine.reset_prefix_cache() is True
        await engine.sleep(level=2)
        assert await engine.is_sleeping()
        await engine.wake_up()
        assert not await engine.is_sleeping()
        assert await generate("b") == before
        assert await engine.collective_rpc(_num_layers) == [3]
        await asyncio.sleep(1.5)  # the output thread logs at least every second

    try:
        with caplog.at_level(logging.INFO, logger="ember"):
            asyncio.run(run())
        lines = _lines(caplog)
        assert lines and sum(float(m.group(2)) for m in lines) > 0
    finally:
        engine.shutdown_sync()


def test_serve_logs_stats_by_default():
    """As vLLM: `ember serve` logs stats unless --disable-log-stats; offline commands do not."""
    import argparse

    from ember.entrypoints.cli_args import add_engine_args
    from ember.entrypoints.cli_serve import add_arguments

    serve = argparse.ArgumentParser()
    add_arguments(serve)
    assert serve.parse_args([]).disable_log_stats is False
    assert serve.parse_args(["--disable-log-stats"]).disable_log_stats is True
    offline = argparse.ArgumentParser()
    add_engine_args(offline)
    assert offline.parse_args([]).disable_log_stats is True
