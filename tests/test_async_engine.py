"""AsyncLLM on a tiny random llama: streaming, concurrency, aborts, errors, a dying engine-core
process and shutdown.

Every test ends with all KV blocks free (asked of the engine core process, between steps).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from conftest import assert_all_blocks_free_async
from model_factory import make_tiny_model

from ember import LLM, EngineArgs, SamplingParams
from ember.engine.async_llm import AsyncLLM, EngineDeadError


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("async")))


def _args(path: str, async_scheduling: bool = False) -> EngineArgs:
    return EngineArgs(model=path, skip_tokenizer_init=True, num_gpu_blocks_override=256,
                      async_scheduling=async_scheduling)


# Both engine modes: with async scheduling (CUDA's default) outputs lag a step behind the
# device and a request can end with a step still in flight.
@pytest.fixture(scope="module", params=[False, True], ids=["sync_steps", "async_scheduling"])
def engine(tiny_path, request):
    engine = AsyncLLM.from_engine_args(_args(tiny_path, request.param))
    yield engine
    engine.shutdown_sync()


def _prompt(n: int, start: int = 3) -> dict:
    return {"prompt_token_ids": [start + (i * 7) % 300 for i in range(n)]}


def _params(**kw) -> SamplingParams:
    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    base.update(kw)
    return SamplingParams(**base)


def _check_free(engine: AsyncLLM) -> None:
    async def idle() -> None:
        for _ in range(200):
            if engine.stats()["num_unfinished_requests"] == 0:
                break
            await asyncio.sleep(0.01)
        await assert_all_blocks_free_async(engine)

    asyncio.run(idle())


async def _collect(engine: AsyncLLM, prompt, params, request_id: str):
    outs = [out async for out in engine.generate(prompt, params, request_id)]
    return outs


def test_stream_matches_offline(engine, tiny_path):
    prompts = [_prompt(n, s) for n, s in ((5, 3), (17, 11), (40, 29))]
    params = _params(logprobs=2)

    async def run():
        return await asyncio.gather(
            *(_collect(engine, p, params, f"s{i}") for i, p in enumerate(prompts))
        )

    streams = asyncio.run(run())
    offline = LLM(tiny_path, skip_tokenizer_init=True, num_gpu_blocks_override=256).generate(
        prompts, params, use_tqdm=False)
    for outs, ref in zip(streams, offline, strict=True):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == sorted(counts)  # cumulative, growing
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(outs[-1].outputs[0].logprobs) == 12
    _check_free(engine)


def test_many_concurrent_and_n(engine):
    async def run():
        tasks = [_collect(engine, _prompt(3 + i % 20, i), _params(n=1 + i % 3, temperature=0.8,
                                                                  seed=i), f"c{i}")
                 for i in range(40)]
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    for i, outs in enumerate(results):
        final = outs[-1]
        assert final.finished and len(final.outputs) == 1 + i % 3
        assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in final.outputs)
    _check_free(engine)


def test_consumer_leaving_aborts(engine):
    async def run():
        gen = engine.generate(_prompt(8), _params(max_tokens=200), "leave")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()  # what `async for` + break leaves to the garbage collector

        started = asyncio.Event()

        async def cancelled():
            async for _ in engine.generate(_prompt(9), _params(max_tokens=240), "cancel"):
                started.set()

        task = asyncio.ensure_future(cancelled())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    _check_free(engine)


def test_external_abort_ends_stream(engine):
    async def run():
        outs = []
        async for out in engine.generate(_prompt(8), _params(max_tokens=200, n=2), "ext"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("ext")
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished
    assert {c.finish_reason for c in outs[-1].outputs} == {"abort"}
    _check_free(engine)


def test_bad_request_fails_only_its_caller(engine):
    async def run():
        good = asyncio.ensure_future(_collect(engine, _prompt(5), _params(), "good"))
        with pytest.raises(ValueError, match="empty"):
            await _collect(engine, {"prompt_token_ids": []}, _params(), "empty")
        with pytest.raises(ValueError, match="vocabulary"):
            await _collect(engine, {"prompt_token_ids": [10**6]}, _params(), "oov")
        with pytest.raises(ValueError, match="tokenizer"):  # text needs the skipped tokenizer
            await _collect(engine, "some text", _params(), "text")
        dup = engine.generate(_prompt(4), _params(max_tokens=50), "dup")
        first = await dup.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, _prompt(4), _params(), "dup")
        await dup.aclose()
        return first, await good

    first, good = asyncio.run(run())
    assert not first.finished and good[-1].finished
    _check_free(engine)


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_killed_core_fails_pending_within_5s(tiny_path):
    engine = AsyncLLM.from_engine_args(_args(tiny_path))
    pid = engine.client.address.pid

    async def run():
        gen = engine.generate(_prompt(5), _params(max_tokens=10_000 // 20), "a")
        await gen.__anext__()
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):
            async for _ in gen:
                pass
        assert time.monotonic() - start < 5.0
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(engine, _prompt(5), _params(), "b")
        with pytest.raises(EngineDeadError):
            await engine.call_core("idle_report")

    asyncio.run(run())
    assert not engine.is_running
    engine.shutdown_sync()
    assert _wait_gone(pid)


def test_failing_step_reports_its_error(tiny_path):
    """A step that raises in the core process ends it; callers get the core's own message."""
    engine = AsyncLLM.from_engine_args(_args(tiny_path))

    async def run():
        await engine.call_core("inject_step_failure", "boom")
        with pytest.raises(EngineDeadError, match="boom"):
            await _collect(engine, _prompt(5), _params(max_tokens=50), "a")
        with pytest.raises(EngineDeadError, match="boom"):
            await engine.check_health()

    asyncio.run(run())
    engine.shutdown_sync()
    assert _wait_gone(engine.client.address.pid)  # exited and reaped


def test_shutdown_aborts_in_flight_and_stops_the_core(tiny_path):
    engine = AsyncLLM.from_engine_args(_args(tiny_path))
    pid = engine.client.address.pid

    async def run():
        gen = engine.generate(_prompt(5), _params(max_tokens=200), "x")
        await gen.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in gen:
                pass

    asyncio.run(run())
    assert not engine.is_running
    assert _wait_gone(pid)  # the core process is gone, not orphaned
