#!/usr/bin/env bash
# One-shot GPU check: the kernels (bench/gpu_check.sh), then the whole engine (bench/gpu_engine.py), on a host
# with one GPU and JAX for CUDA but without this repo installed (bench/gpu_env.sh). Needs .gpu/tokenizer.gguf
# (python bench/gpu_engine.py --write-tokenizer .gpu).
# Usage on the GPU host: bash bench/gpu_run.sh   (about 8 minutes; each part has a hard stop)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
KERNEL_BUDGET=${KERNEL_BUDGET:-200} bash "$REPO/bench/gpu_check.sh"
cd "$REPO" && timeout --signal=INT --kill-after=15 ${ENGINE_TIMEOUT:-270} \
  python3 bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --time-budget ${ENGINE_BUDGET:-200} 2>&1 \
  | tee -a "${OUT:-/tmp}/gpu_engine.log"
