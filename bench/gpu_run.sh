#!/usr/bin/env bash
# One-shot GPU check: the kernels (bench/gpu_check.sh), then the whole engine (bench/gpu_engine.py), on a host
# with one GPU and JAX for CUDA but without this repo installed (bench/gpu_env.sh). Needs .gpu/tokenizer.gguf
# (python bench/gpu_engine.py --write-tokenizer .gpu).
# Then the engine again at Llama-3-8B shapes (bf16 zeros made on the device, Pallas attention, async and sync).
# Then the step's truth at Llama-3-8B shapes (bench/gpu_engine.py --step-truth): output tok/s at 1 / 64 / 256
# concurrent requests of 1,024 tokens in and 1,024 out at the engine's default GPU budgets, decode-only and mixed
# ms/step beside their floors (bytes / HBM bandwidth, flops / peak), host ms/step, and whether the jitted step
# returns before the device is done.
# Every engine here is the sharded path: one SPMD program over the GPU's mesh (see bench/gpu_engine.py).
# Last, the per-kernel profile of one mixed and one decode-only step at Llama-3-8B shapes (bench/gpu_profile.py).
# Usage on the GPU host: bash bench/gpu_run.sh   (under 10 minutes, one command's limit on a lent
# device: each part has a hard stop, and the stops add up to 580 s)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
KERNEL_BUDGET=${KERNEL_BUDGET:-70} bash "$REPO/bench/gpu_check.sh"
cd "$REPO" && timeout --signal=INT --kill-after=15 ${ENGINE_TIMEOUT:-110} \
  python3 bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --time-budget ${ENGINE_BUDGET:-80} 2>&1 \
  | tee -a "${OUT:-/tmp}/gpu_engine.log"
timeout --signal=INT --kill-after=15 ${BIG_TIMEOUT:-90} \
  python3 bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --preset llama-3-8b --zeros-on-device --impls pallas \
  --skip-agreement --skip-single-stream --time-budget ${BIG_BUDGET:-55} 2>&1 | tee -a "${OUT:-/tmp}/gpu_engine.log"
# A count starts only before TRUTH_BUDGET s; 256 requests take about 80 s (warm-up and timed run).
timeout --signal=INT --kill-after=15 ${TRUTH_TIMEOUT:-150} \
  python3 bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --preset llama-3-8b --zeros-on-device --impls pallas \
  --step-truth --concurrency 1,64,256 --input-len 1024 --output-len 1024 --time-budget ${TRUTH_BUDGET:-80} 2>&1 \
  | tee -a "${OUT:-/tmp}/gpu_engine.log"
timeout --signal=INT --kill-after=15 ${PROFILE_TIMEOUT:-100} \
  python3 bench/gpu_profile.py --tokenizer .gpu/tokenizer.gguf --preset llama-3-8b --zeros-on-device \
  --num-requests 64 --prompt-len 1024 --out "${OUT:-/tmp}/profile" 2>&1 | tee -a "${OUT:-/tmp}/gpu_profile.log"
