"""Offline throughput benchmark (same as `ember bench throughput`); see docs/benchmarks.md."""

import sys

from ember.entrypoints.cli_bench import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
