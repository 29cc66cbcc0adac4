#!/usr/bin/env bash
# The main job: set up (idempotent), then a steered, captured generation on SmolLM2-135M
# through the instrumented vLLM engine (GPU if present, else vLLM's CPU build).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
echo "demo: running .venv/bin/tl-vllm demo $*"
exec "$ROOT/.venv/bin/tl-vllm" demo "$@"
