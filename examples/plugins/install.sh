#!/usr/bin/env bash
# Installs ember's example plugins into the venv (editable), so that `ember plugins` lists them
# and CI runs `LLM` through each. Safe to run again.
#   examples/plugins/install.sh                 ember-olmo, ember-paged-torch, ember-cpu-variant
#   examples/plugins/install.sh --with-broken   also ember-broken-plugin (fails to load on purpose:
#                                               every ember process then logs its error once)
#   examples/plugins/install.sh --uninstall     removes all four
# PYTHON=/path/to/python picks another interpreter (default: the repo's .venv).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
PY="${PYTHON:-$root/.venv/bin/python}"
plugins=(ember-olmo ember-paged-torch ember-cpu-variant)
case "${1:-}" in
  --with-broken) plugins+=(ember-broken-plugin) ;;
  --uninstall)
    exec "$PY" -m pip uninstall -q -y "${plugins[@]}" ember-broken-plugin ;;
  "") ;;
  *) echo "usage: $0 [--with-broken | --uninstall]" >&2; exit 2 ;;
esac
args=()
for p in "${plugins[@]}"; do args+=(-e "$here/$p"); done
# --no-deps: they depend on ember (installed from this repo) and torch, already in the venv;
# --no-build-isolation: build with the venv's setuptools, no index needed.
"$PY" -m pip install -q --no-deps --no-build-isolation "${args[@]}"
echo "installed example plugins: ${plugins[*]}"
