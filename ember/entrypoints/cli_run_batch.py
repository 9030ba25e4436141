"""`ember run-batch -i IN.jsonl -o OUT.jsonl [engine flags]`: an OpenAI batch file, offline.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}`; each output line, in input order, is `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}` (vLLM's `run_batch` format). A line
that does not parse, or a request the server would refuse, gets `body: null` and an `error`
object; the other lines still run.

The bodies go through the server's own FastAPI app (request models, validation, handlers) called
in process over ASGI, so a batch line means exactly what the same POST to `ember serve` means;
an AsyncLLM engine serves them, at most --max-concurrency at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any

from ember.entrypoints.cli_args import add_engine_args

URLS = ("/v1/chat/completions", "/v1/completions")


def _random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _output(custom_id: Any, status: int, body: Any = None, error: Any = None) -> dict[str, Any]:
    return {
        "id": _random_id("batch_req"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": _random_id("ember-batch"),
                     "body": body},
        "error": error,
    }


def _bad_line(custom_id: Any, message: str) -> dict[str, Any]:
    return _output(custom_id, 400, error={"message": message, "type": "invalid_request_error",
                                          "code": "invalid_batch_line"})


def parse_line(number: int, line: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the request, None), or (None, the error entry this line gets)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, _bad_line(None, f"line {number}: not JSON: {exc}")
    if not isinstance(item, dict):
        return None, _bad_line(None, f"line {number}: not a JSON object")
    custom_id = item.get("custom_id")
    problem = None
    if not isinstance(custom_id, str):
        problem = "custom_id must be a string"
    elif item.get("method", "POST") != "POST":
        problem = f"method {item.get('method')!r} is not supported: only POST"
    elif item.get("url") not in URLS:
        problem = f"url {item.get('url')!r} is not supported: one of {', '.join(URLS)}"
    elif not isinstance(item.get("body"), dict):
        problem = "body must be a JSON object"
    elif item["body"].get("stream"):
        problem = "stream is not supported in a batch file: each response is written whole"
    if problem:
        return None, _bad_line(custom_id if isinstance(custom_id, str) else None,
                               f"line {number}: {problem}")
    return item, None


async def post(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """One POST through an ASGI app, in process: (status, response body)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }
    sent = False
    never = asyncio.Event()  # the "client" never disconnects: its batch waits for every answer

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    status, chunks = 500, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def run_request(app: Any, item: dict[str, Any]) -> dict[str, Any]:
    try:
        status, raw = await post(app, item["url"], json.dumps(item["body"]).encode())
    except Exception as exc:  # a handler's crash fails its line, never the whole batch
        return _output(item["custom_id"], 500, error={"message": f"{type(exc).__name__}: {exc}",
                                                      "type": "server_error"})
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError:
        payload = {"error": {"message": raw.decode(errors="replace"), "type": "server_error"}}
    if status == 200:
        return _output(item["custom_id"], status, body=payload)
    return _output(item["custom_id"], status, error=payload.get("error", payload))


async def run_batch(app: Any, lines: list[str], max_concurrency: int,
                    progress: bool = True) -> list[dict[str, Any]]:
    """Every non-empty line's output entry, in input order."""
    from tqdm.auto import tqdm

    gate = asyncio.Semaphore(max_concurrency)
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    bar = tqdm(total=len(numbered), desc="run-batch", unit="req", disable=not progress)

    async def one(number: int, line: str) -> dict[str, Any]:
        item, error = parse_line(number, line)
        if item is not None:
            async with gate:
                error = await run_request(app, item)
        bar.update(1)
        return error  # type: ignore[return-value]

    try:
        return list(await asyncio.gather(*(one(n, line) for n, line in numbered)))
    finally:
        bar.close()


async def _main(ns: argparse.Namespace) -> int:
    from ember import envs
    from ember.engine.async_llm import AsyncLLM
    from ember.entrypoints.cli_args import engine_args_from
    from ember.entrypoints.openai.api_server import build_app, served_names

    with open(ns.input_file, encoding="utf-8") as f:
        lines = f.read().splitlines()
    args = engine_args_from(ns)
    engine = AsyncLLM.from_engine_args(args)
    try:
        app = build_app(engine, served_names(ns, args), shutdown_engine_on_exit=False)
        outputs = await run_batch(app, lines, ns.max_concurrency,
                                  progress=not envs.disable_progress_bars())
    finally:
        await engine.shutdown()
    with open(ns.output_file, "w", encoding="utf-8") as f:
        for entry in outputs:
            f.write(json.dumps(entry) + "\n")
    failed = sum(entry["error"] is not None for entry in outputs)
    print(f"run-batch: {len(outputs)} requests, {failed} failed; results in {ns.output_file}",
          file=sys.stderr)
    return 0


def cmd_run_batch(ns: argparse.Namespace) -> int:
    if ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    return asyncio.run(_main(ns))


def add_subparser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) offline, results to a JSONL file")
    parser.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL)")
    parser.add_argument("-o", "--output-file", required=True, help="where results go (JSONL)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model names the bodies may give (default: --model, or the "
                             "embedded model's name); a body without one gets the model")
    parser.add_argument("--max-concurrency", type=int, default=256,
                        help="requests in flight at once (the engine batches them)")
    add_engine_args(parser)
    parser.set_defaults(func=cmd_run_batch)
