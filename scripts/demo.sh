#!/usr/bin/env bash
# The main job: set up (idempotent), then a steered, captured `inspect eval` of
# evals/steering_demo.py on SmolLM2-135M through the tl-vllm provider: the ocean vector is
# added at layer 12 and the mean residual stream at that layer is stored per sample.
# Runs on the GPU when there is one, else on vLLM's CPU build (eager, fp32).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
LOG_DIR=${LOG_DIR:-logs}
ARGS=(-M steer=evals/steer_ocean.yaml -M capture=blocks.12.hook_resid_post -M capture_reduce=mean)
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  ARGS+=(-M enforce_eager=true -M dtype=float32 -M max_model_len=1024)
  export TORCH_COMPILE_DISABLE=1  # CPU: skip minutes of C++ compilation
  echo "demo: no GPU, running on vLLM's CPU build (eager, fp32)"
fi
echo "demo: inspect eval evals/steering_demo.py@steering_demo --model tl-vllm/smollm2 ${ARGS[*]} --log-dir $LOG_DIR $*"
inspect eval evals/steering_demo.py@steering_demo --model tl-vllm/smollm2 "${ARGS[@]}" --log-dir "$LOG_DIR" --display plain "$@"
LOG=$(ls -t "$LOG_DIR"/*.eval | head -n 1)
echo "demo: log $LOG; activations in ${LOG%.eval}.activations/"
tl-vllm activations "$LOG"
echo "demo: for the unsteered baseline, run the same command without -M steer=..."
