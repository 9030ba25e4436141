"""The client side of `ember bench serve`: streaming requests sent from one or several processes.

One asyncio/httpx loop sends its requests as a Poisson process (or all at once), reads each
streamed response and times the first token and the gaps between chunks. At tens of thousands of
streamed chunks per second one interpreter becomes the bottleneck (every chunk is an SSE line
parsed from JSON), so `run_clients` can split the requests round-robin over several spawned
processes, each running the same loop over its share at its share of the rate; a barrier starts
them together, and the run lasts from the first start to the last end.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import random
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

# How long a client process may take to start (spawn + imports) before the run gives up.
_START_TIMEOUT_S = 300.0


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


@dataclass
class ClientPlan:
    """What one client loop sends: the request bodies, to where, how fast, how many at a time."""

    base_url: str
    path: str
    bodies: list[dict]
    headers: dict[str, str] = field(default_factory=dict)
    request_rate: float = float("inf")  # requests per second, Poisson; inf = all at once
    max_concurrency: int | None = None
    seed: int = 0  # of the arrival gaps

    def split(self, parts: int) -> list[ClientPlan]:
        """Round-robin shares, each at 1/parts of the rate and of the concurrency limit."""
        limit = None if self.max_concurrency is None else math.ceil(self.max_concurrency / parts)
        return [replace(self, bodies=self.bodies[i::parts], request_rate=self.request_rate / parts,
                        max_concurrency=limit, seed=self.seed + 1000 * i)
                for i in range(parts) if self.bodies[i::parts]]


async def _one(client, path: str, body: dict, headers: dict) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if not any(c.get("text") or (c.get("delta") or {}).get("content")
                           for c in choices):
                    continue  # the role chunk, or a finish-only chunk
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except Exception as exc:  # a benchmark reports failures, it does not stop at them
        result.error = repr(exc)
    return result


@dataclass
class ShareRun:
    """One client loop's run: start and end on the monotonic clock, which all processes of one
    machine share (so runs of several processes merge), and the CPU time the loop used."""

    results: list[RequestResult]
    start: float
    end: float
    cpu_s: float


@dataclass
class ClientRun:
    results: list[RequestResult]
    duration: float
    # The busiest client process's CPU time over the run's duration: near 1.0 means the client,
    # not the server, may have set the pace (add --client-processes).
    client_cpu_busy: float


async def _send(plan: ClientPlan, barrier=None) -> ShareRun:
    """Runs one plan in this process's event loop."""
    import httpx

    rng = random.Random(plan.seed)
    limit = asyncio.Semaphore(plan.max_concurrency or max(len(plan.bodies), 1))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=plan.base_url, timeout=httpx.Timeout(3600.0),
                                 limits=limits) as client:

        async def limited(body: dict) -> RequestResult:
            async with limit:
                return await _one(client, plan.path, body, plan.headers)

        if barrier is not None:
            barrier.wait(_START_TIMEOUT_S)  # nothing else runs on this loop yet
        start, cpu_start = time.monotonic(), time.process_time()
        tasks = []
        for body in plan.bodies:
            tasks.append(asyncio.ensure_future(limited(body)))
            if plan.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(plan.request_rate))
        results = await asyncio.gather(*tasks)
        return ShareRun(list(results), start, time.monotonic(), time.process_time() - cpu_start)


_barrier: threading.Barrier | None = None


def _init_worker(barrier) -> None:
    import logging

    global _barrier
    _barrier = barrier
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _run_loop(coroutine):
    """asyncio.run, on uvloop where it is installed (a faster loop: more chunks read per second)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    if not hasattr(asyncio, "Runner"):  # Python 3.10
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


def _send_in_worker(plan: ClientPlan) -> ShareRun:
    return _run_loop(_send(plan, _barrier))


def run_clients(plan: ClientPlan, processes: int = 1) -> ClientRun:
    """Sends the plan from `processes` client processes (1: in this process)."""
    if processes <= 1:
        runs = [_run_loop(_send(plan))]
    else:
        shares = plan.split(processes)
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        barrier = context.Barrier(len(shares))
        with ProcessPoolExecutor(len(shares), mp_context=context, initializer=_init_worker,
                                 initargs=(barrier,)) as pool:
            runs = list(pool.map(_send_in_worker, shares))
    duration = max(run.end for run in runs) - min(run.start for run in runs)
    return ClientRun(results=[r for run in runs for r in run.results], duration=duration,
                     client_cpu_busy=max(run.cpu_s for run in runs) / duration)
