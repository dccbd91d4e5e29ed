# Sourced by the entry points: find or make the Python environment.
#
# - ATTN_PYTHON=/path/to/python: use that interpreter as it is (e.g. a GPU
#   machine whose image already holds numba-cuda; nothing is installed).
# - an active virtual environment ($VIRTUAL_ENV): install into it.
# - otherwise: create .venv in the repository (once) and install into it.
# The install (`pip install -e .[test,bench]`) is redone when setup.cfg or
# pyproject.toml changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -n "${ATTN_PYTHON:-}" ]; then
  PY="$ATTN_PYTHON"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  if [ -n "${VIRTUAL_ENV:-}" ]; then
    PY="$VIRTUAL_ENV/bin/python"
  else
    if [ ! -x .venv/bin/python ]; then
      echo "setting up .venv (first run)..." >&2
      python3 -m venv .venv
    fi
    PY="$ROOT/.venv/bin/python"
  fi
  stamp="$(dirname "$PY")/../.attn-installed"
  want="$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing the project and its dependencies..." >&2
    "$PY" -m pip install -q --upgrade pip >&2
    "$PY" -m pip install -q -e ".[test,bench]" >&2
    echo "$want" > "$stamp"
  fi
fi
export PY
