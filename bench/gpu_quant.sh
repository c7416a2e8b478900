#!/usr/bin/env bash
# The quantization check on one GPU: Llama-3-8B's shapes (bf16 zeros made on the device, quantized on load), output
# tok/s for bf16, int8, fp8 and int4 weights at 1, 64 and 256 concurrent requests (bench/gpu_engine.py
# --quant-sweep), on a host set up as for bench/gpu_run.sh (bench/gpu_env.sh; .gpu/tokenizer.gguf).
# Usage on the GPU host: bash bench/gpu_quant.sh   (8 minutes at most: a hard stop)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
cd "$REPO" && timeout --signal=INT --kill-after=15 ${QUANT_TIMEOUT:-480} \
  python3 bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --preset llama-3-8b --zeros-on-device \
  --impls pallas --skip-agreement --skip-throughput --skip-single-stream --quant-sweep bf16,int8,fp8,int4 \
  --concurrency 1,64,256 --time-budget ${QUANT_BUDGET:-420} 2>&1 | tee -a "${OUT:-/tmp}/gpu_quant.log"
