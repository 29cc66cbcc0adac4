#!/usr/bin/env bash
# The test suite: set up (idempotent), lint with ruff, then pytest on the real vLLM engine
# (CPU build without a GPU).  Extra arguments go to pytest, e.g. `scripts/test.sh -k steering`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
echo "test: ruff check"
"$ROOT/.venv/bin/ruff" check src tests bench
echo "test: pytest $*"
start=$(date +%s)
"$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
echo "test: finished in $(( $(date +%s) - start )) s"
