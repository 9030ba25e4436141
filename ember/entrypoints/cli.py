"""The `ember` command: generate, chat, bench, serve, plugins, complete, run-batch, collect-env."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ember.entrypoints.cli_args import add_engine_args, engine_args_from


def _sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None)


def _params(ns):
    from ember import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
        seed=ns.sampling_seed,
    )


def _make_llm(ns):
    from ember import LLM

    args = engine_args_from(ns)
    return LLM(**dataclasses.asdict(args))


def cmd_generate(ns: argparse.Namespace) -> int:
    llm = _make_llm(ns)
    prompts = ns.prompt or [sys.stdin.read()]
    if ns.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], _params(ns),
                           use_tqdm=False)
    else:
        outputs = llm.generate(prompts, _params(ns), use_tqdm=False)
    for output in outputs:
        print(output.outputs[0].text)
    return 0


def _changed_engine_flags(ns: argparse.Namespace) -> list[str]:
    from ember.config import EngineArgs

    # The defaults as the parser itself gives them (however cli_args derives them).
    defaults = vars(build_parser().parse_args([ns.command]))
    return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineArgs)
            if f.name in defaults and getattr(ns, f.name) != defaults[f.name]]


def cmd_chat(ns: argparse.Namespace) -> int:
    from ember.entrypoints import cli_client

    if ns.url:  # a client of a running server: the engine flags would do nothing there
        changed = _changed_engine_flags(ns)
        if changed:
            raise ValueError(f"{', '.join(changed)} configure an offline engine and do nothing "
                             "with --url (the server's engine is already configured)")
        return cli_client.run_chat(ns)
    client_only = [flag for flag, value in (("--model-name", ns.model_name),
                                            ("--api-key", ns.api_key)) if value is not None]
    if client_only:
        raise ValueError(f"{', '.join(client_only)} need --url (a server to talk to); offline "
                         "chat takes --model")
    llm = _make_llm(ns)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    for line in cli_client.prompts(ns):
        history.append({"role": "user", "content": line.strip()})
        reply = llm.chat(history, _params(ns), use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="ember LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts (default: the embedded model)")
    gen.add_argument("prompt", nargs="*", help="prompts (stdin when none)")
    gen.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap each prompt as a user chat message (default on)")
    _sampling_flags(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat over stdin: offline, or with a server at --url")
    chat.add_argument("--system", "--system-prompt", dest="system", default=None,
                      help="system prompt")
    _sampling_flags(chat)
    add_engine_args(chat)
    from ember.entrypoints.cli_client import add_client_args

    add_client_args(chat, url_default=None)
    chat.set_defaults(func=cmd_chat)

    for module_name in ("cli_plugins", "cli_bench", "cli_serve", "cli_client", "cli_run_batch",
                        "cli_collect_env"):
        try:
            module = __import__(f"ember.entrypoints.{module_name}", fromlist=["add_subparser"])
        except ImportError:
            continue
        module.add_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    from ember import envs

    logging.basicConfig(level=envs.logging_level(), format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
