"""`ember bench throughput|serve`: the benchmarks, as CLI subcommands."""

from __future__ import annotations

import argparse


def add_subparser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (throughput, serve)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    from ember.bench import throughput

    tp = kinds.add_parser("throughput", help="offline throughput vs HF transformers")
    throughput.add_arguments(tp)
    tp.set_defaults(func=throughput.main)
    try:
        from ember.bench import serve
    except ImportError:
        return
    sv = kinds.add_parser("serve", help="online serving benchmark against a running server")
    serve.add_arguments(sv)
    sv.set_defaults(func=serve.main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    return ns.func(ns)
