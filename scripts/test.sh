#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole CPU test suite; GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check ember tests
exec .venv/bin/python -m pytest -q "$@"
