"""`ember serve [MODEL]`: run the OpenAI-compatible server (the embedded model when none)."""

from __future__ import annotations

import argparse

from ember.entrypoints.cli_args import add_engine_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF directory or .gguf file (default: the embedded SmolLM2 GGUF)")
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
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(parser, with_model=False)


def cmd_serve(ns: argparse.Namespace) -> int:
    from ember.entrypoints.openai.api_server import run_server

    return run_server(ns)


def add_subparser(subparsers) -> None:
    serve = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_arguments(serve)
    serve.set_defaults(func=cmd_serve)
