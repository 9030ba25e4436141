"""``python -m ember.bench throughput|serve ...``: the ``ember bench`` subcommands without the
console script. The kernel benchmarks run as ``python -m ember.bench.NAME`` (see __init__)."""

import sys

from ember.entrypoints.cli_bench import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
