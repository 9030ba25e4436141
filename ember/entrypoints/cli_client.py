"""`ember complete` and `ember chat --url`: clients of a running OpenAI-compatible server.

    ember complete [--url URL] [--model-name NAME] [--api-key KEY] [-q "text"]
    ember chat --url URL [--model-name NAME] [--system-prompt TEXT] [-q "text"]

They mirror vLLM's `vllm complete` / `vllm chat`: the model defaults to the first one the server
lists, `-q` sends one prompt and exits, otherwise every stdin line is a prompt until EOF (chat
keeps the conversation), and the reply is streamed as it arrives. They talk through the official
`openai` package (the `client` extra), imported only when a command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

DEFAULT_URL = "http://localhost:8000/v1"


def add_client_args(parser: argparse.ArgumentParser, url_default: str | None) -> None:
    """Flags shared by both clients; `url_default` None keeps `chat` offline unless --url."""
    group = parser.add_argument_group("server client")
    group.add_argument("--url", default=url_default,
                       help=f"the server's OpenAI base URL (e.g. {DEFAULT_URL})")
    group.add_argument("--model-name", default=None,
                       help="model to ask for (default: the first one /v1/models lists)")
    group.add_argument("--api-key", default=None,
                       help="API key (default: EMBER_API_KEY, then OPENAI_API_KEY)")
    group.add_argument("-q", "--quick", default=None, metavar="TEXT",
                       help="send this one prompt, print the reply and exit")


def _client(ns: argparse.Namespace) -> Any:
    try:
        import openai
    except ImportError:
        raise SystemExit("ember complete / chat --url need the openai client: "
                         "pip install openai (or pip install 'ember[client]')") from None
    import logging

    from ember import envs

    # `ember` logs at INFO; the HTTP library's line per request would bury the replies.
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # The openai client refuses to start without some key; an open server ignores it.
    key = ns.api_key or envs.api_key() or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    return openai.OpenAI(base_url=ns.url, api_key=key)


def _model(client: Any, ns: argparse.Namespace) -> str:
    if ns.model_name:
        return ns.model_name
    models = client.models.list().data
    if not models:
        raise SystemExit(f"the server at {ns.url} lists no models")
    return models[0].id


def _sampling(ns: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags this command has, as request fields. A flag left at its neutral value
    is not sent, so the server's defaults stay in charge."""
    values: dict[str, Any] = {
        "max_tokens": ns.max_tokens, "temperature": ns.temperature,
        "top_p": None if getattr(ns, "top_p", 1.0) == 1.0 else ns.top_p,
        "seed": getattr(ns, "sampling_seed", None),
    }
    kwargs = {k: v for k, v in values.items() if v is not None}
    if getattr(ns, "top_k", 0) > 0:
        kwargs["extra_body"] = {"top_k": ns.top_k}  # a vLLM extra the openai client lacks
    return kwargs


def _guarded(run):
    """A server that is down or answers an error ends the command with one line, not a
    traceback."""

    def wrapper(ns: argparse.Namespace, client: Any) -> int:
        import openai

        try:
            return run(ns, client)
        except openai.APIConnectionError as exc:
            print(f"error: the connection to the server at {ns.url} failed: {exc}",
                  file=sys.stderr)
        except openai.APIStatusError as exc:
            print(f"error: the server answered {exc.status_code}: {exc.message}",
                  file=sys.stderr)
        return 1

    return wrapper


def prompts(ns: argparse.Namespace):
    """The -q text, or each non-empty stdin line (a "> " prompt only on a terminal)."""
    if ns.quick is not None:
        yield ns.quick
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _stream_out(chunks, text_of) -> str:
    """Print each chunk's text as it comes; the whole reply."""
    parts: list[str] = []
    for chunk in chunks:
        piece = text_of(chunk) if chunk.choices else None
        if piece:
            parts.append(piece)
            print(piece, end="", flush=True)
    print(flush=True)
    return "".join(parts)


def run_complete(ns: argparse.Namespace) -> int:
    client = _client(ns)
    return _guarded(_complete)(ns, client)


def _complete(ns: argparse.Namespace, client: Any) -> int:
    model = _model(client, ns)
    for prompt in prompts(ns):
        stream = client.completions.create(model=model, prompt=prompt, stream=True,
                                           **_sampling(ns))
        _stream_out(stream, lambda c: c.choices[0].text)
    return 0


def run_chat(ns: argparse.Namespace) -> int:
    client = _client(ns)
    return _guarded(_chat)(ns, client)


def _chat(ns: argparse.Namespace, client: Any) -> int:
    model = _model(client, ns)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    for prompt in prompts(ns):
        history.append({"role": "user", "content": prompt})
        stream = client.chat.completions.create(model=model, messages=history, stream=True,
                                                **_sampling(ns))
        reply = _stream_out(stream, lambda c: c.choices[0].delta.content)
        history.append({"role": "assistant", "content": reply})
    return 0


def add_subparser(subparsers: Any) -> None:
    complete = subparsers.add_parser(
        "complete", help="text completions from a running server (stdin lines or -q)")
    add_client_args(complete, url_default=DEFAULT_URL)
    complete.add_argument("--max-tokens", type=int, default=None,
                          help="tokens per completion (default: the server's, 16)")
    complete.add_argument("--temperature", type=float, default=None)
    complete.set_defaults(func=run_complete)
