#!/usr/bin/env bash
# One-shot GPU check: the kernels (bench/gpu_check.sh), then the whole engine (bench/gpu_engine.py), on a host
# with one GPU and JAX for CUDA but without this repo installed (bench/gpu_env.sh). Needs .gpu/tokenizer.gguf
# (python bench/gpu_engine.py --write-tokenizer .gpu).
# Then the engine again at Llama-3-8B shapes (bf16 zeros made on the device, Pallas attention, async and sync).
# Every engine here is the sharded path: one SPMD program over the GPU's mesh (see bench/gpu_engine.py).
# Last, the per-kernel profile of one mixed and one decode-only step at Llama-3-8B shapes (bench/gpu_profile.py).
# Usage on the GPU host: bash bench/gpu_run.sh   (about 11 minutes; each part has a hard stop)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
KERNEL_BUDGET=${KERNEL_BUDGET:-140} bash "$REPO/bench/gpu_check.sh"
cd "$REPO" && timeout --signal=INT --kill-after=15 ${ENGINE_TIMEOUT:-170} \
  python3 bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --time-budget ${ENGINE_BUDGET:-130} 2>&1 \
  | tee -a "${OUT:-/tmp}/gpu_engine.log"
timeout --signal=INT --kill-after=15 ${BIG_TIMEOUT:-170} \
  python3 bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --preset llama-3-8b --zeros-on-device --impls pallas \
  --skip-agreement --skip-single-stream --time-budget ${BIG_BUDGET:-110} 2>&1 | tee -a "${OUT:-/tmp}/gpu_engine.log"
timeout --signal=INT --kill-after=15 ${PROFILE_TIMEOUT:-150} \
  python3 bench/gpu_profile.py --tokenizer .gpu/tokenizer.gguf --preset llama-3-8b --zeros-on-device \
  --num-requests 64 --prompt-len 1024 --out "${OUT:-/tmp}/profile" 2>&1 | tee -a "${OUT:-/tmp}/gpu_profile.log"
