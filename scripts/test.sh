#!/usr/bin/env bash
# The test suite: set up (idempotent), lint with ruff, then pytest on the real vLLM engine
# (CPU build without a GPU), with the newest inspect-ai and transformers PyPI serves (a fresh
# set-up installs them).  Then the other end of the supported ranges: the provider tests again in
# an environment holding the oldest inspect-ai and transformers that pyproject.toml admits
# (scripts/range_env.py).  Extra arguments go to the first pytest only and skip the second run,
# e.g. `scripts/test.sh -k steering`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
echo "test: ruff check"
"$ROOT/.venv/bin/ruff" check src tests bench scripts evals
echo "test: pytest $*"
start=$(date +%s)
"$PY" -m pytest -q -p no:cacheprovider "$@"
echo "test: newest end finished in $(( $(date +%s) - start )) s ($("$PY" -c 'import inspect_ai, transformers; print("inspect-ai", inspect_ai.__version__, "transformers", transformers.__version__)'))"
if [ $# -eq 0 ]; then
  start=$(date +%s)
  echo "test: oldest end: building $ROOT/.venv/oldest with the lower bounds of pyproject.toml and this package's wheel"
  "$PY" scripts/range_env.py "$ROOT/.venv/oldest" --oldest --wheel
  "$ROOT/.venv/oldest/env/bin/python" -m pytest -q -p no:cacheprovider tests/test_provider.py tests/test_tool_calls.py
  echo "test: oldest end finished in $(( $(date +%s) - start )) s"
fi
