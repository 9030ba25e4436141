"""`ember bench serve`: online serving benchmark against the OpenAI-compatible server.

Starts `ember serve` in a subprocess (so the client never competes with the engine for the GIL),
or targets a running server with --base-url; sends N streaming requests arriving as a Poisson
process at --request-rate (inf = all at once), at most --max-concurrency in flight, from
--client-processes client processes (serve_client.py); reports request and token throughput and
TTFT / TPOT / ITL / end-to-end latency percentiles; --out writes the results as JSON, with the
server's command line. --poisson-at-fraction F adds a second run on the same server, Poisson at F
times the first run's request throughput (TTFT under load that the server keeps up with), on new
prompts of the same lengths.

A dummy-weight model directory holds only config.json; the started server then gets a copy of it
with a word-level tokenizer of the config's vocabulary size (word_tokenizer.py), made
automatically or with --word-tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host_platform
import random
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import replace

from ember.bench.provenance import git_commit
from ember.bench.serve_client import ClientPlan, ClientRun, RequestResult, run_clients

PERCENTILES = (50, 90, 99)

__all__ = ["RequestResult", "add_arguments", "main", "summarize"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None,
                        help="a running server (default: start `ember serve` for the run)")
    parser.add_argument("--model", default=None, help="model for the started server")
    parser.add_argument("--served-model-name", default="bench")
    parser.add_argument("--server-args", default="",
                        help="extra `ember serve` flags, e.g. '--api-server-count 4 "
                             "--load-format dummy --max-model-len 4096'")
    parser.add_argument("--word-tokenizer", action=argparse.BooleanOptionalAction, default=None,
                        help="serve a copy of the --model directory with a word-level tokenizer "
                             "of its vocabulary size (default: when the directory has no "
                             "tokenizer, as the dummy-weight configs in ember/configs)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--poisson-at-fraction", type=float, default=None,
                        help="then, on the same server, a Poisson run at this fraction of the "
                             "first run's request throughput (JSON key 'poisson')")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes sharing the requests (and the rate) round-robin, "
                             "so the client keeps up with tens of thousands of chunks a second")
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
    parser.add_argument("--warmup-prompts", type=int, default=1,
                        help="short requests (16 tokens, prompts of the workload shifted by one "
                             "token id so the prefix cache misses) sent before the clock starts; "
                             "64 matches `ember bench throughput`'s warm-up")
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


def _plan(ns: argparse.Namespace, base_url: str) -> ClientPlan:
    return ClientPlan(
        base_url=base_url,
        path="/v1/chat/completions" if ns.endpoint == "chat" else "/v1/completions",
        bodies=_bodies(ns),
        headers={"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {},
        request_rate=ns.request_rate, max_concurrency=ns.max_concurrency, seed=ns.seed + 1,
    )


def _warmup_plan(plan: ClientPlan, count: int) -> ClientPlan:
    """The first `count` requests, 16 tokens each, token-id prompts shifted by one id, all at
    once: the measured run then pays no one-time costs and gets no prefix-cache hits from them."""
    bodies = []
    for body in plan.bodies[:max(count, 1)]:
        body = {**body, "max_tokens": 16}
        if isinstance(body.get("prompt"), list):
            body["prompt"] = [t + 1 for t in body["prompt"]]
        bodies.append(body)
    return replace(plan, bodies=bodies, request_rate=float("inf"), max_concurrency=None)


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


def summarize(results: list[RequestResult], duration: float,
              client_cpu_busy: float | None = None) -> dict:
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
    if client_cpu_busy is not None:
        summary["client_cpu_busy"] = client_cpu_busy
    summary.update(_summary("ttft", [r.ttft for r in ok]))
    summary.update(_summary("tpot", tpot))
    summary.update(_summary("itl", [v for r in ok for v in r.itl]))
    summary.update(_summary("e2el", [r.latency for r in ok]))
    return summary


def _summarize_run(run: ClientRun) -> dict:
    return summarize(run.results, run.duration, run.client_cpu_busy)


def _print(summary: dict, title: str) -> None:
    print("=" * 20 + f" {title} " + "=" * 20)
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


def _wants_word_tokenizer(ns: argparse.Namespace) -> bool:
    from ember.bench.word_tokenizer import has_tokenizer

    is_dir = bool(ns.model) and os.path.isdir(ns.model)
    if ns.word_tokenizer and not is_dir:
        raise SystemExit("--word-tokenizer needs --model DIR, a directory holding config.json")
    if ns.word_tokenizer is not None:
        return ns.word_tokenizer
    return is_dir and not has_tokenizer(ns.model)


def _server_command(ns: argparse.Namespace, model: str | None, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "ember.entrypoints.cli", "serve"]
    cmd += [model] if model else []
    cmd += ["--port", str(port), "--served-model-name", ns.served_model_name,
            "--uvicorn-log-level", "warning", *shlex.split(ns.server_args)]
    if ns.api_key:
        cmd += ["--api-key", ns.api_key]
    return cmd


def _api_server_count(server_args: str) -> int:
    """The --api-server-count passed through --server-args (the server's default is 1)."""
    args = shlex.split(server_args)
    for i, arg in enumerate(args):
        if arg == "--api-server-count" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--api-server-count="):
            return int(arg.split("=", 1)[1])
    return 1


def _start_server(cmd: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    import httpx

    port = cmd[cmd.index("--port") + 1]
    env = {**os.environ, "EMBER_DISABLE_PROGRESS": "1"}
    # Its own process group, so that stopping it reaches every process it started.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`{shlex.join(cmd)}` exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    _stop_server(proc)
    raise RuntimeError("the server did not become healthy in time")


def _stop_server(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        proc.terminate()  # SIGTERM to the server: it shuts down its own children
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group outlived it
    except ProcessLookupError:
        pass


def _measure(ns: argparse.Namespace, base_url: str) -> tuple[dict, dict | None]:
    plan = _plan(ns, base_url)
    run_clients(_warmup_plan(plan, ns.warmup_prompts))
    summary = _summarize_run(run_clients(plan, ns.client_processes))
    _print(summary, "Serving Benchmark Result")
    poisson = None
    if ns.poisson_at_fraction and summary["request_throughput"] > 0:
        rate = ns.poisson_at_fraction * summary["request_throughput"]
        # New prompts (another seed): the burst's would all be prefix-cache hits by now.
        poisson_ns = argparse.Namespace(**{**vars(ns), "request_rate": rate, "seed": ns.seed + 1})
        poisson_plan = _plan(poisson_ns, base_url)
        poisson = {"request_rate": rate,
                   **_summarize_run(run_clients(poisson_plan, ns.client_processes))}
        _print(poisson, f"Poisson at {rate:.2f} req/s")
    return summary, poisson


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(ns: argparse.Namespace) -> int:
    import logging
    import signal

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    # A time limit (`timeout`) sends SIGTERM: unwind, so that the server is stopped too and
    # does not hold the accelerator for the next run.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    proc = None
    base_url = ns.base_url
    cmd: list[str] | None = None
    word_dir = None
    try:
        if base_url is None:
            model = ns.model
            if _wants_word_tokenizer(ns):
                from ember.bench.word_tokenizer import write_word_tokenizer_model

                model = word_dir = write_word_tokenizer_model(ns.model)
                print(f"serving {ns.model} with a word-level tokenizer from {word_dir}")
            cmd = _server_command(ns, model, _free_port())
            proc, base_url = _start_server(cmd, ns.startup_timeout)
        summary, poisson = _measure(ns, base_url)
    finally:
        if proc is not None:
            _stop_server(proc)
        if word_dir is not None:
            shutil.rmtree(word_dir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    if ns.out:
        args = {k: str(v) if v == float("inf") else v  # JSON has no Infinity
                for k, v in vars(ns).items() if k != "func"}
        record = {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                  "machine": host_platform.processor() or host_platform.machine(),
                  "cpus": os.cpu_count(), "args": args,
                  "server_cmd": shlex.join(cmd) if cmd else None,
                  "api_server_count": _api_server_count(ns.server_args) if cmd else None,
                  "client_processes": ns.client_processes, "results": summary}
        if poisson is not None:
            record["poisson"] = poisson
        with open(ns.out, "w") as f:
            json.dump(record, f, indent=2, default=str)
    failed = summary["failed"] + (poisson["failed"] if poisson else 0)
    return 0 if failed == 0 else 1
