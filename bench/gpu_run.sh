#!/usr/bin/env bash
# The one entry point of the GPU benchmarks (bench/README.md, docs/BENCHMARKS.md): one step per
# device call (at most 10 minutes each).  On a machine staged as ../shared/gpu/README.md says,
# run `check` first: it installs this package and prepares SmolLM2, which every other step needs
# (`install` does only that, ~1 min, when the checks are not wanted).
#
# The steps behind the current results in docs/BENCHMARKS.md:
#   bash bench/gpu_run.sh check  OUTDIR   # install, prepare SmolLM2, hook_cost, router_cost, gpu_check (~4 min)
#   bash bench/gpu_run.sh 8b-scaled OUTDIR   # throughput, Llama-3-8B shape, weights at training-init scale (~4 min)
#   bash bench/gpu_run.sh writers OUTDIR  # capture_all with 4 writer threads, then with 1 (~7 min)
#   bash bench/gpu_run.sh smol   OUTDIR   # throughput, SmolLM2 (~5 min)
#   bash bench/gpu_run.sh smol-plain OUTDIR  # SmolLM2, vanilla and plain only, 8 rounds; PY_SPY=BIN
#                                          # profiles plain before the first and after the last (~3 min)
#   bash bench/gpu_run.sh e2e-warm OUTDIR # inspect eval: vllm/ vs tl-vllm steered and captured, caches warm (~8 min)
#   bash bench/gpu_run.sh e2e-connections OUTDIR  # tl-vllm with --max-connections 256 vs its default (~5 min)
#   bash bench/gpu_run.sh e2e-boot OUTDIR  # tl-vllm booting at the model's construction (eager) vs in the
#                                          # background while Inspect starts the eval, caches warm (~5 min)
#   bash bench/gpu_run.sh e2e-store OUTDIR  # tl-vllm plain vs capturing every layer per prompt token, stored
#                                          # beside the log by the provider, equal work, caches warm (~5 min)
#   bash bench/gpu_run.sh e2e-store-natural OUTDIR  # the same, each answer as long as the model makes it
#                                          # (greedy, at most 256 tokens), so samples end at different steps
#   bash bench/gpu_run.sh e2e-rounds OUTDIR  # vllm/ vs tl-vllm plain, every sample exactly 256 tokens, 3 interleaved
#                                          # rounds: medians with their spread (~7 min)
#   bash bench/gpu_run.sh e2e-equal OUTDIR  # vllm/ vs tl-vllm plain and steered + captured, every sample
#                                          # exactly 256 tokens (ignore_eos), caches warm (~9 min; cut off at
#                                          # 570 s, its JSON keeps the variants it finished)
#
# When one call is all the device time left after staging (~7 min):
#   bash bench/gpu_run.sh quick  OUTDIR   # install, gpu_check, router_cost, then the 1B shape: vanilla, plain,
#                                          # steer, capture, 3 rounds, until the call's time runs out (~8 min)
#
# vLLM's two model runners side by side (vLLM 0.20.2: V1 and Model Runner V2, the only runner of 0.34):
#   bash bench/gpu_run.sh v2-check OUTDIR  # install, gpu_check on V2 (~4 min)
#   bash bench/gpu_run.sh verify-V2 OUTDIR  # install, `tl-vllm verify --compiled` on V2 (verify-V1: on V1; ~4 min)
#   bash bench/gpu_run.sh runners-1b OUTDIR  # throughput, Llama-3.2-1B shape, the five variants, 5 rounds on V2's two
#                                          # engines, then on V1's, each runner against its own vanilla (~8 min)
#   bash bench/gpu_run.sh runners-8b OUTDIR  # the same in the Llama-3-8B shape, 3 rounds (~9 min)
#   bash bench/gpu_run.sh steer-1b OUTDIR  # 1B shape: vanilla, plain, steer with tensors and with lists, 5 rounds,
#                                          # on V2 then on V1 (~9 min; RUNNERS=V2: V2 only, ~4 min)
#
# Quantized weights and LoRA adapters, and the GPU runs of the CPU suite's per-head and adapter tests:
#   bash bench/gpu_run.sh quantized OUTDIR  # install; quantized_check.py: steering, head ablation and capture
#                                          # on SmolLM2 with fp8, a GPTQ checkpoint and a LoRA adapter (~8 min)
#   bash bench/gpu_run.sh quant-tests OUTDIR  # tests/test_lora.py and tests/test_head_hooks.py, compiled (~8 min)
#   bash bench/gpu_run.sh fp8-1b OUTDIR    # throughput, Llama-3.2-1B shape, fp8 (dummy weights) vs vanilla fp8 (~4 min)
#   bash bench/gpu_run.sh gptq-1b OUTDIR   # the same on a 4-bit GPTQ checkpoint (random weights, checkpoints.py) (~6 min)
#   bash bench/gpu_run.sh lora-1b OUTDIR   # the same with a rank-16 LoRA adapter on every request (~6 min)
#
# Other model shapes, and the peer hotwire-vllm (steering only) beside the instrumented engine,
# all with weights at training-init scale:
#   bash bench/gpu_run.sh 1b     OUTDIR   # throughput, Llama-3.2-1B shape, the five standard variants (~3 min)
#   bash bench/gpu_run.sh 1b-long OUTDIR  # the same with 10 rounds, for medians that resolve 1-2% (~5 min)
#   bash bench/gpu_run.sh 1b-pinned OUTDIR  # 1b-long with each engine on CPUs of its own (--pin-cpus on),
#                                          # to compare its spread with 1b-long's (~5 min)
#   bash bench/gpu_run.sh 2b     OUTDIR   # throughput, Gemma-2-2B shape, the five standard variants (~4 min)
#   bash bench/gpu_run.sh peers-1b OUTDIR # the five and hotwire, Llama-3.2-1B shape, three engines at 0.3 of
#                                          # the GPU's memory each (~4 min)
#   bash bench/gpu_run.sh peers-8b OUTDIR # the same, Llama-3-8B shape (~6 min: hotwire compiles cold)
#   bash bench/gpu_run.sh 8b-store OUTDIR # capture_all, then stored as the provider stores it, in shards on the
#                                          # local disk and in a moto S3 server on localhost (bundle moto[server]
#                                          # and s3fs), 3 rounds (~5 min)
#   bash bench/gpu_run.sh sae-8b OUTDIR   # a 65,536-feature SAE at layer 16: steer by a feature, clamp one,
#                                          # capture the top 32 features per token and of the answer's mean;
#                                          # beside steer and the same hook captured raw per token (~7 min)
#   bash bench/gpu_run.sh sae-capture-8b OUTDIR  # SAE capture per token against the same rows captured raw,
#                                          # and over the prompt only, 3 rounds (~5 min)
# The peers steps install hotwire from bench/peers/ into /tmp/tlvllm-hotwire, a folder on no
# path but that of the hotwire engine's process (throughput.py --hotwire-dir).
#
# Diagnostic steps (the findings in docs/BENCHMARKS.md):
#   bash bench/gpu_run.sh 8b     OUTDIR   # throughput, 8B shape with vLLM's dummy weights (~4 min; PY_SPY=BIN adds profiles)
#   bash bench/gpu_run.sh 8b-nodetok OUTDIR  # the same without detokenizing, four variants (~3 min)
#   bash bench/gpu_run.sh late-writes OUTDIR  # capture_all with TLVLLM_EARLY_WRITES=0 (~3 min)
#   bash bench/gpu_run.sh diag   OUTDIR   # steer vs steer_zero, capture_all, 3 rounds, py-spy (PY_SPY=BIN) (~5 min)
#   bash bench/gpu_run.sh e2e    OUTDIR   # inspect eval: vllm/ vs tl-vllm plain and steered, caches as found (~5 min)
#
# Then, anywhere:
#   python3 bench/tables.py OUTDIR        # markdown tables from the step's JSON
#
# Each step writes its JSON and log into OUTDIR.  If the fused hook kernel fails its check
# against the reference in `check`, later steps run with TLVLLM_FUSED_HOOK=0 (torch ops)
# and say so.
set -uo pipefail
cd "$(dirname "$0")/.."
step=${1:?usage: gpu_run.sh install|check|quick|quantized|quant-tests|fp8-1b|gptq-1b|lora-1b|v2-check|verify-V1|verify-V2|steer-1b|runners-1b|runners-8b|8b|8b-scaled|8b-nodetok|late-writes|writers|diag|e2e|e2e-warm|e2e-connections|e2e-boot|e2e-store|e2e-store-natural|e2e-rounds|e2e-equal|smol|smol-plain|1b|1b-long|1b-pinned|2b|peers-1b|peers-8b|8b-store|sae-8b|sae-capture-8b OUTDIR}
out=${2:?usage: gpu_run.sh STEP OUTDIR}
mkdir -p "$out"
[ -f /tmp/tlvllm/env.sh ] && . /tmp/tlvllm/env.sh
if [ -f /tmp/tlvllm-fused-off ]; then
  export TLVLLM_FUSED_HOOK=0
  echo "[gpu_run] the fused hook kernel failed its check: running the torch-op hooks" | tee -a "$out/$step.log"
fi
log="$out/$step.log"
# This package installed (for its entry points) and SmolLM2 prepared; fails if either failed.
install_package() {
  local status=0
  python3 -m pip install -q --no-deps --no-index --no-build-isolation . >"$log" 2>&1 || status=$?
  python3 -m inspect_tl_vllm.cli prepare-model smollm2 >>"$log" 2>&1 || status=$?
  return $status
}
case "$step" in
  install)
    install_package
    ;;
  check)
    install_package
    if ! timeout 150 python3 bench/hook_cost.py --out "$out/hook_cost_8b.json" >>"$log" 2>&1; then
      touch /tmp/tlvllm-fused-off
      export TLVLLM_FUSED_HOOK=0
      echo "[gpu_run] hook_cost: fused kernel check FAILED" | tee -a "$log"
    fi
    timeout 60 python3 bench/router_cost.py --out "$out/router_cost.json" >>"$log" 2>&1
    timeout 330 python3 bench/gpu_check.py --requests 256 --out "$out/gpu_check.json" >>"$log" 2>&1
    ;;
  quick)
    install_package
    timeout -k 15 210 python3 bench/gpu_check.py --requests 256 --out "$out/gpu_check.json" >>"$log" 2>&1
    timeout 40 python3 bench/router_cost.py --out "$out/router_cost.json" >>"$log" 2>&1
    timeout 240 python3 bench/throughput.py --model llama1b-shape --prompts 256 --new-tokens 256 --runs 3 \
      --weights scaled --variants vanilla,plain,steer,capture --out "$out/throughput_1b_quick.json" >>"$log" 2>&1
    ;;
  8b)
    timeout 570 python3 bench/throughput.py --model llama8b-shape --prompts 256 --new-tokens 256 --runs 5 \
      ${PY_SPY:+--py-spy "$PY_SPY"} --out "$out/throughput_8b.json" >"$log" 2>&1
    ;;
  8b-scaled)
    timeout 570 python3 bench/throughput.py --model llama8b-shape --prompts 256 --new-tokens 256 --runs 5 \
      --weights scaled --out "$out/throughput_8b_scaled.json" >"$log" 2>&1
    ;;
  8b-nodetok)
    timeout 570 python3 bench/throughput.py --model llama8b-shape --prompts 256 --new-tokens 256 --runs 5 \
      --no-detokenize --variants vanilla,plain,steer,capture --out "$out/throughput_8b_nodetok.json" >"$log" 2>&1
    ;;
  late-writes)
    TLVLLM_EARLY_WRITES=0 timeout 570 python3 bench/throughput.py --model llama8b-shape --prompts 256 \
      --new-tokens 256 --runs 5 --variants vanilla,plain,capture_all --out "$out/throughput_8b_late_writes.json" >"$log" 2>&1
    ;;
  writers)
    for threads in 4 1; do
      TLVLLM_WRITER_THREADS=$threads timeout 285 python3 bench/throughput.py --model llama8b-shape --prompts 256 \
        --new-tokens 256 --runs 5 --weights scaled --variants vanilla,plain,capture_all \
        --out "$out/throughput_8b_writers_$threads.json" >>"$log" 2>&1
    done
    ;;
  diag)
    timeout 570 python3 bench/throughput.py --model llama8b-shape --prompts 256 --new-tokens 256 --runs 3 \
      --variants vanilla,plain,steer,steer_zero,capture_all ${PY_SPY:+--py-spy "$PY_SPY"} \
      --out "$out/throughput_8b_diag.json" >"$log" 2>&1
    ;;
  e2e)
    timeout 570 python3 bench/e2e.py --samples 256 --timeout 185 --out "$out/e2e.json" >"$log" 2>&1
    ;;
  e2e-connections)
    timeout 570 python3 bench/e2e.py --samples 256 --timeout 185 --warm-up --variants tl,tl_default_connections \
      --out "$out/e2e_connections.json" >"$log" 2>&1
    ;;
  e2e-warm)
    timeout 570 python3 bench/e2e.py --samples 256 --timeout 185 --warm-up --variants vllm,tl_steer_capture \
      --out "$out/e2e_warm.json" >"$log" 2>&1
    ;;
  e2e-boot)
    timeout 570 python3 bench/e2e.py --samples 256 --timeout 185 --warm-up --variants tl,tl_background \
      --out "$out/e2e_boot.json" >"$log" 2>&1
    ;;
  e2e-store)
    timeout 570 python3 bench/e2e.py --samples 256 --max-tokens 256 --timeout 185 --warm-up --ignore-eos \
      --variants tl,tl_capture_all --out "$out/e2e_store.json" >"$log" 2>&1
    ;;
  e2e-store-natural)
    timeout 570 python3 bench/e2e.py --samples 256 --max-tokens 256 --timeout 185 --warm-up \
      --variants tl,tl_capture_all --out "$out/e2e_store_natural.json" >"$log" 2>&1
    ;;
  e2e-rounds)
    timeout 570 python3 bench/e2e.py --samples 256 --max-tokens 256 --timeout 185 --warm-up --ignore-eos \
      --variants vllm,tl --rounds 3 --out "$out/e2e_rounds.json" >"$log" 2>&1
    ;;
  e2e-equal)
    timeout 570 python3 bench/e2e.py --samples 256 --max-tokens 256 --timeout 185 --warm-up --ignore-eos \
      --variants vllm,tl,tl_steer_capture --out "$out/e2e_equal.json" >"$log" 2>&1
    ;;
  smol)
    timeout 570 python3 bench/throughput.py --model smollm2 --prompts 256 --new-tokens 256 --runs 5 \
      --out "$out/throughput_smollm2.json" >"$log" 2>&1
    ;;
  smol-plain)
    timeout 300 python3 bench/throughput.py --model smollm2 --prompts 256 --new-tokens 256 --runs 8 \
      --variants vanilla,plain ${PY_SPY:+--py-spy "$PY_SPY"} --out "$out/throughput_smollm2_plain.json" >"$log" 2>&1
    ;;
  1b)
    timeout 570 python3 bench/throughput.py --model llama1b-shape --prompts 256 --new-tokens 256 --runs 5 \
      --weights scaled --out "$out/throughput_1b_scaled.json" >"$log" 2>&1
    ;;
  2b)
    timeout 570 python3 bench/throughput.py --model gemma2b-shape --prompts 256 --new-tokens 256 --runs 5 \
      --weights scaled --out "$out/throughput_2b_scaled.json" >"$log" 2>&1
    ;;
  1b-long)
    timeout 570 python3 bench/throughput.py --model llama1b-shape --prompts 256 --new-tokens 256 --runs 10 \
      --weights scaled --out "$out/throughput_1b_scaled_long.json" >"$log" 2>&1
    ;;
  1b-pinned)
    timeout 570 python3 bench/throughput.py --model llama1b-shape --prompts 256 --new-tokens 256 --runs 10 \
      --weights scaled --pin-cpus on --out "$out/throughput_1b_scaled_pinned.json" >"$log" 2>&1
    ;;
  sae-8b)
    timeout 570 python3 bench/throughput.py --model llama8b-shape --prompts 256 --new-tokens 256 --runs 5 \
      --weights scaled --variants vanilla,plain,steer,sae_steer,sae_clamp,sae_capture,sae_capture_mean,capture_tokens \
      --out "$out/throughput_8b_sae.json" >"$log" 2>&1
    ;;
  sae-capture-8b)
    timeout 570 python3 bench/throughput.py --model llama8b-shape --prompts 256 --new-tokens 256 --runs 3 \
      --weights scaled --variants vanilla,plain,capture_tokens,sae_capture,sae_capture_prompt \
      --out "$out/throughput_8b_sae_capture.json" >"$log" 2>&1
    ;;
  8b-store)
    timeout 570 python3 bench/throughput.py --model llama8b-shape --prompts 256 --new-tokens 256 --runs 3 \
      --weights scaled --variants vanilla,capture_all,capture_all_disk,capture_all_s3 \
      --out "$out/throughput_8b_store.json" >"$log" 2>&1
    ;;
  quantized)
    install_package
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    timeout 560 python3 bench/quantized_check.py --out "$out/quantized_check.json" >"$log" 2>&1
    ;;
  quant-tests)
    VLLM_WORKER_MULTIPROC_METHOD=spawn timeout 570 python3 -m pytest -q -p no:cacheprovider \
      tests/test_lora.py tests/test_head_hooks.py >"$log" 2>&1
    ;;
  fp8-1b)
    timeout 560 python3 bench/throughput.py --model llama1b-shape --prompts 256 --new-tokens 256 --runs 5 \
      --quantization fp8 --variants vanilla,plain,steer,capture,capture_all \
      --out "$out/throughput_1b_fp8.json" >"$log" 2>&1
    ;;
  gptq-1b)
    timeout 120 python3 bench/checkpoints.py gptq llama1b-shape /tmp/tlvllm-bench/llama1b-gptq >"$log" 2>&1 &&
      timeout 440 python3 bench/throughput.py --model /tmp/tlvllm-bench/llama1b-gptq --prompts 256 \
        --new-tokens 256 --runs 5 --variants vanilla,plain,steer,capture,capture_all \
        --out "$out/throughput_1b_gptq.json" >>"$log" 2>&1
    ;;
  lora-1b)
    python3 bench/checkpoints.py lora llama1b-shape /tmp/tlvllm-bench/llama1b-lora >"$log" 2>&1 &&
      timeout 540 python3 bench/throughput.py --model llama1b-shape --prompts 256 --new-tokens 256 --runs 5 \
        --weights scaled --lora /tmp/tlvllm-bench/llama1b-lora --variants vanilla,plain,steer,capture,capture_all \
        --out "$out/throughput_1b_lora.json" >>"$log" 2>&1
    ;;
  v2-check)
    install_package
    VLLM_USE_V2_MODEL_RUNNER=1 timeout -k 15 240 python3 bench/gpu_check.py --requests 256 \
      --out "$out/gpu_check_v2.json" >>"$log" 2>&1
    ;;
  verify-V1 | verify-V2)  # the user's self-check, compiled then eager, on one runner
    runner=${step#verify-}
    install_package
    VLLM_USE_V2_MODEL_RUNNER=$([ "$runner" = V2 ] && echo 1 || echo 0) timeout -k 15 280 \
      python3 -m inspect_tl_vllm.verify --compiled >"$out/verify_$runner.log" 2>&1
    echo "[gpu_run] verify on $runner exited $?" | tee -a "$log"
    ;;
  steer-1b)  # steering with vectors as tensors (the Python API's path) and as lists (a JSON spec's), V2 then V1
    for runner in ${RUNNERS:-V2 V1}; do
      timeout 255 python3 bench/throughput.py --model llama1b-shape --prompts 256 --new-tokens 256 --runs 5 \
        --weights scaled --variants vanilla,plain,steer,steer_list --runners $runner \
        --out "$out/throughput_1b_steer_$runner.json" >>"$log" 2>&1
    done
    ;;
  runners-1b | runners-8b)  # V2's pair of engines (vanilla, instrumented), then V1's, each runner against its own vanilla
    size=${step#runners-}
    for runner in V2 V1; do
      timeout 285 python3 bench/throughput.py --model llama$size-shape --prompts 256 --new-tokens 256 \
        --runs "$([ "$size" = 1b ] && echo 5 || echo 3)" --weights scaled \
        --variants vanilla,plain,steer,capture,capture_all --runners $runner \
        --out "$out/throughput_${size}_$runner.json" >>"$log" 2>&1
    done
    ;;
  peers-1b | peers-8b)
    size=${step#peers-}
    hotwire_dir=/tmp/tlvllm-hotwire
    python3 -m pip install -q --no-deps --no-index --upgrade --target "$hotwire_dir" \
      bench/peers/hotwire_vllm-0.1.2-py3-none-any.whl >"$log" 2>&1 &&
      timeout 570 python3 bench/throughput.py --model "llama$size-shape" --prompts 256 --new-tokens 256 --runs 5 \
        --weights scaled --variants vanilla,plain,steer,capture,capture_all,hotwire --gpu-memory-utilization 0.3 \
        --hotwire-dir "$hotwire_dir" --out "$out/throughput_${size}_peers.json" >>"$log" 2>&1
    ;;
  *)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
status=$?
echo "[gpu_run] $step exited $status" | tee -a "$log"
tail -n 25 "$log"
exit $status
