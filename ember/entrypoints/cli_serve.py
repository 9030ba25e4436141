"""`ember serve [MODEL]`: run the OpenAI-compatible server (the embedded model when none)."""

from __future__ import annotations

import argparse

from ember.entrypoints.cli_args import add_engine_args
from ember.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES, DESCRIPTORS_KEPT_FREE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF directory, .gguf file or hub name such as org/name (default: "
                             "the embedded SmolLM2 GGUF)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (or EMBER_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use; the first is reported in responses")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let in-flight requests finish before "
                             "aborting them")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="HTTP server processes in front of the one engine core (tokenizing, "
                             "detokenizing and streaming spread over them); metrics sum up")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests replace the chat template (chat_template field); "
                             "off by default: a template runs code-like Jinja on the server")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide to call tools (tool_choice "auto"); needs '
                             "--tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None,
                        help="how tool calls are read from the output: hermes, llama3_json, "
                             "mistral or a plugin's (`ember plugins` lists them)")
    parser.add_argument("--reasoning-parser", default=None,
                        help="split reasoning_content from the answer: qwen3, deepseek_r1 or a "
                             "plugin's")
    limits = parser.add_argument_group("limits on clients")
    limits.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get a 413 before they are read "
                             f"(default {DEFAULT_MAX_BODY_BYTES})")
    limits.add_argument("--max-connections", type=int, default=None,
                        help="open connections at most; more are reset at once (default: the "
                             f"open-file limit, raised to its hard limit, less "
                             f"{DESCRIPTORS_KEPT_FREE})")
    limits.add_argument("--timeout-request-head", type=float, default=10.0,
                        help="seconds a connection may take to send a request's line and "
                             "headers before it is closed (default 10)")
    limits.add_argument("--timeout-body-idle", type=float, default=30.0,
                        help="seconds a request body may stop arriving before a 408 "
                             "(default 30)")
    limits.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open (default 5)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(parser, with_model=False)
    # vLLM's serve logs stats by default (its offline LLM does not): --disable-log-stats turns
    # the periodic lines off.
    parser.set_defaults(disable_log_stats=False)


def cmd_serve(ns: argparse.Namespace) -> int:
    from ember.entrypoints.openai.api_server import run_server

    return run_server(ns)


def add_subparser(subparsers) -> None:
    serve = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_arguments(serve)
    serve.set_defaults(func=cmd_serve)
