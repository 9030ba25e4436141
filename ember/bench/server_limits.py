"""``python -m ember.bench.server_limits``: how the server holds up against hostile clients.

Starts ``ember serve`` on the default model (or the ember tree given by --tree, for a side-by-side
run against an older commit) and measures ``/health`` latency (p50/p99 over sequential
requests on a fresh connection each) in three phases, with the server's resident memory (its
own process and the engine core's) before and after:

    idle          nothing else going on (the baseline)
    big-body      while another client keeps sending 50 MB prompts (valid JSON) to
                  /v1/completions
    long-prompt   while another client keeps sending the longest prompt text the server still
                  tokenizes (too long for the context once tokenized: a 400 after tokenizing)
    idle-conns    while 5,000 connections are held open without a request (re-opened as the
                  server closes them)

--out writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from ember.bench.provenance import git_commit


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _tree_rss_mb(pid: int) -> float:
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += _rss_mb(p)
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(c) for c in children)
    return total


def _health_once(port: int, timeout: float) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    if b" 200 " not in data.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"/health answered {data[:80]!r}")
    return time.perf_counter() - start


def _health_latencies(port: int, count: int, timeout: float, budget: float) -> dict:
    """`count` sequential /health requests, or as many as fit `budget` seconds."""
    times, failures = [], 0
    end = time.monotonic() + budget
    for _ in range(count):
        if time.monotonic() > end:
            break
        try:
            times.append(_health_once(port, timeout))
        except (OSError, RuntimeError):
            failures += 1
        time.sleep(0.01)
    if not times:
        return {"failures": failures}
    times.sort()
    return {"p50_ms": 1000 * statistics.median(times),
            "p99_ms": 1000 * times[min(len(times) - 1, int(0.99 * len(times)))],
            "max_ms": 1000 * times[-1], "requests": len(times), "failures": failures}


def _send_long_prompts(port: int, chars: int, stop: threading.Event, results: list) -> None:
    import httpx

    body = {"prompt": "hello " * (chars // 6), "max_tokens": 1}
    while not stop.is_set():
        start = time.perf_counter()
        try:
            status = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                timeout=300).status_code
        except httpx.HTTPError:
            status = None
        results.append((status, time.perf_counter() - start))


def _answers(sends: list) -> dict:
    counts: dict[str, int] = {}
    for status, _ in sends:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return {"answers": counts, "answer_seconds_max": max((t for _, t in sends), default=None)}


def _send_big_bodies(port: int, size: int, stop: threading.Event, results: list) -> None:
    # Valid JSON of exactly `size` bytes: a server without a body limit parses and tokenizes it.
    head, tail = b'{"prompt": "', b'", "max_tokens": 1}'
    filler = b"hello " * ((1 << 20) // 6)
    while not stop.is_set():
        start = time.perf_counter()
        status = None
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: %d\r\n\r\n" % size)
                sock.sendall(head)
                sent, body_end = len(head), size - len(tail)
                try:
                    while sent < body_end and not stop.is_set():
                        chunk = filler[: min(len(filler), body_end - sent)]
                        sock.sendall(chunk)
                        sent += len(chunk)
                    sock.sendall(tail)
                except OSError:
                    pass  # refused early: the server closed while we were still sending
                sock.settimeout(300)
                head = sock.recv(4096)
                status = int(head.split()[1]) if head else None
        except OSError:
            pass
        results.append((status, time.perf_counter() - start))


def _hold_idle_connections(port: int, count: int, stop: threading.Event,
                           held: list[socket.socket]) -> None:
    while not stop.is_set():
        alive = []
        for sock in held:
            try:  # a closed one reads as b"" at once; an open one would block
                sock.setblocking(False)
                if sock.recv(1) == b"":
                    sock.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                continue
            alive.append(sock)
        held[:] = alive
        while len(held) < count and not stop.is_set():
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            except OSError:
                time.sleep(0.05)
                break
        stop.wait(0.2)


def run(args: argparse.Namespace) -> dict:
    from ember.entrypoints.openai.limits import raise_open_file_limit

    raise_open_file_limit()  # the client holds thousands of sockets too
    port = args.port
    env = {**os.environ, "EMBER_DISABLE_PROGRESS": "1"}
    if args.tree:
        env["PYTHONPATH"] = os.path.abspath(args.tree)
    cmd = [sys.executable, "-m", "ember.entrypoints.cli", "serve", "--port", str(port),
           "--max-model-len", "2048", "--uvicorn-log-level", "warning", *args.serve_args]
    log = open(args.log, "w") if args.log else subprocess.DEVNULL
    # `-m` puts the working directory first on sys.path: run from the tree to serve from it.
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              cwd=os.path.abspath(args.tree) if args.tree else None)
    result: dict = {"commit": git_commit(), "tree": args.tree, "command": cmd}
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            try:
                _health_once(port, 1)
                break
            except (OSError, RuntimeError):
                time.sleep(0.5)
        result["rss_mb_before"] = _tree_rss_mb(server.pid)
        result["idle"] = _health_latencies(port, args.requests, args.timeout, args.phase_seconds)
        print("idle", result["idle"], flush=True)

        stop, sends = threading.Event(), []
        sender = threading.Thread(target=_send_big_bodies,
                                  args=(port, args.body_mb << 20, stop, sends), daemon=True)
        sender.start()
        time.sleep(0.5)
        result["big_body"] = _health_latencies(port, args.requests, args.timeout, args.phase_seconds)
        stop.set()
        sender.join(args.timeout)
        result["big_body"].update(_answers(sends))
        print("big-body", result["big_body"], flush=True)

        if args.prompt_chars:
            stop, sends = threading.Event(), []
            sender = threading.Thread(target=_send_long_prompts,
                                      args=(port, args.prompt_chars, stop, sends), daemon=True)
            sender.start()
            time.sleep(0.5)
            result["long_prompt"] = _health_latencies(port, args.requests, args.timeout,
                                                      args.phase_seconds)
            stop.set()
            sender.join(args.timeout)
            result["long_prompt"].update(_answers(sends))
            result["long_prompt"]["prompt_chars"] = args.prompt_chars
            print("long-prompt", result["long_prompt"], flush=True)

        stop, held = threading.Event(), []
        holder = threading.Thread(target=_hold_idle_connections,
                                  args=(port, args.connections, stop, held), daemon=True)
        holder.start()
        deadline = time.monotonic() + 60
        while len(held) < args.connections and time.monotonic() < deadline:
            time.sleep(0.1)
        result["idle_conns"] = _health_latencies(port, args.requests, args.timeout, args.phase_seconds)
        result["idle_conns"]["held"] = len(held)
        stop.set()
        holder.join(30)
        for sock in held:
            sock.close()
        print("idle-conns", result["idle_conns"], flush=True)
        time.sleep(1.0)
        result["rss_mb_after"] = _tree_rss_mb(server.pid)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    print(json.dumps({k: result[k] for k in ("rss_mb_before", "rss_mb_after") if k in result}))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--tree", default=None, help="an ember source tree to serve from")
    parser.add_argument("--requests", type=int, default=300, help="/health requests per phase")
    parser.add_argument("--body-mb", type=int, default=50)
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--prompt-chars", type=int, default=300_000,
                        help="the long-prompt phase's prompt length (0: skip the phase); the "
                             "default is just under what the server tokenizes at "
                             "--max-model-len 2048 for the default model")
    parser.add_argument("--timeout", type=float, default=120.0, help="per /health request")
    parser.add_argument("--phase-seconds", type=float, default=60.0,
                        help="stop a phase's /health requests after this long")
    parser.add_argument("--log", default=None, help="the server's log file")
    parser.add_argument("--out", default=None)
    parser.add_argument("serve_args", nargs="*", help="more `ember serve` flags (after --)")
    args = parser.parse_args(argv)
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
