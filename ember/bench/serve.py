"""`ember bench serve`: online serving benchmark against the OpenAI-compatible server.

Starts `ember serve` in a subprocess (so the client never competes with the engine for the GIL),
or targets a running server with --base-url; sends N streaming requests arriving as a Poisson
process at --request-rate (inf = all at once), at most --max-concurrency in flight; reports
request and token throughput and TTFT / TPOT / ITL / end-to-end latency percentiles; --out writes
the results as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform as host_platform
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ember.bench.provenance import git_commit

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None,
                        help="a running server (default: start `ember serve` for the run)")
    parser.add_argument("--model", default=None, help="model for the started server")
    parser.add_argument("--served-model-name", default="bench")
    parser.add_argument("--server-args", default="",
                        help="extra `ember serve` flags, e.g. '--max-model-len 2048'")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--dataset", choices=["random", "fixed"], default="random",
                        help="random: random token ids (completions) or words (chat); "
                             "fixed: --prompt for every request")
    parser.add_argument("--prompt", default="Tell me a story about a lighthouse keeper.")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="let requests stop at EOS (output lengths then vary)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")


# ---- workload ----------------------------------------------------------------------------
_WORDS = ("time person year way day thing man world life hand part child eye woman place work "
          "week case point number group problem fact river light stone garden music").split()


def _bodies(ns: argparse.Namespace) -> list[dict]:
    rng = random.Random(ns.seed)
    bodies = []
    for i in range(ns.num_prompts):
        body: dict = {"model": ns.served_model_name, "max_tokens": ns.output_len,
                      "temperature": ns.temperature, "seed": ns.seed + i, "stream": True,
                      "stream_options": {"include_usage": True},
                      "ignore_eos": not ns.no_ignore_eos}
        if ns.dataset == "fixed":
            text = ns.prompt
        else:
            text = " ".join(rng.choice(_WORDS) for _ in range(ns.input_len))
        if ns.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        elif ns.dataset == "random":
            # Token ids give the exact input length; nano-vllm's range keeps them ordinary.
            body["prompt"] = [rng.randint(100, 10000) for _ in range(ns.input_len)]
        else:
            body["prompt"] = text
        bodies.append(body)
    return bodies


# ---- one request -------------------------------------------------------------------------
async def _one(client, url: str, body: dict, headers: dict) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
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


async def _run(ns: argparse.Namespace, base_url: str) -> tuple[list[RequestResult], float]:
    import httpx

    path = "/v1/chat/completions" if ns.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    bodies = _bodies(ns)
    rng = random.Random(ns.seed + 1)
    limit = asyncio.Semaphore(ns.max_concurrency or len(bodies))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600.0),
                                 limits=limits) as client:

        async def limited(body: dict) -> RequestResult:
            async with limit:
                return await _one(client, path, body, headers)

        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.ensure_future(limited(body)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(ns.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# ---- report ------------------------------------------------------------------------------
def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _summary(name: str, values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    out = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else 0.0}
    out.update({f"p{p}_{name}_ms": _pct(ms, p) for p in PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
    }
    summary.update(_summary("ttft", [r.ttft for r in ok]))
    summary.update(_summary("tpot", tpot))
    summary.update(_summary("itl", [v for r in ok for v in r.itl]))
    summary.update(_summary("e2el", [r.latency for r in ok]))
    return summary


def _print(summary: dict) -> None:
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    for key, value in summary.items():
        if key == "errors":
            continue
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<40}{text:>20}")
    for error in summary["errors"]:
        print("error:", error)


# ---- server lifecycle --------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(ns: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "ember.entrypoints.cli", "serve"]
    cmd += [ns.model] if ns.model else []
    cmd += ["--port", str(port), "--served-model-name", ns.served_model_name,
            "--uvicorn-log-level", "warning", *shlex.split(ns.server_args)]
    if ns.api_key:
        cmd += ["--api-key", ns.api_key]
    env = {**os.environ, "EMBER_DISABLE_PROGRESS": "1"}
    proc = subprocess.Popen(cmd, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ns.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`{shlex.join(cmd)}` exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become healthy in time")


def main(ns: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    proc = None
    base_url = ns.base_url
    if base_url is None:
        proc, base_url = _start_server(ns)
    try:
        # Warm-up: one short request, so the first measured one pays no one-time costs.
        warm = argparse.Namespace(**{**vars(ns), "num_prompts": 1, "output_len": 2})
        asyncio.run(_run(warm, base_url))
        results, duration = asyncio.run(_run(ns, base_url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    summary = summarize(results, duration)
    _print(summary)
    if ns.out:
        args = {k: str(v) if v == float("inf") else v  # JSON has no Infinity
                for k, v in vars(ns).items() if k != "func"}
        record = {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                  "machine": host_platform.processor() or host_platform.machine(),
                  "cpus": os.cpu_count(), "args": args, "results": summary}
        with open(ns.out, "w") as f:
            json.dump(record, f, indent=2, default=str)
    return 0 if summary["failed"] == 0 else 1
