"""Command-line flags for every EngineArgs field, shared by `generate`, `chat`, `serve`, `bench`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from ember.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model" and not with_model:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = str(hints[f.name])
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
        if hint.startswith("dict"):  # vLLM's form: a JSON object on the command line
            group.add_argument(flag, type=_json_object, default=default, metavar="JSON")
        elif "bool" in hint:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif "int" in hint and "float" not in hint:
            group.add_argument(flag, type=int, default=default)
        elif "float" in hint:
            group.add_argument(flag, type=float, default=default)
        else:
            group.add_argument(flag, type=str, default=default)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)}
    return EngineArgs(**values)
