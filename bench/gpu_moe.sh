#!/usr/bin/env bash
# The MoE GPU check (issue: Qwen3-30B-A3B shapes on one GPU): bf16 random weights drawn on the device (61 GB: an
# H200, not an H100), the engine's sharded path with ragged_dot experts, output tok/s with 1, 64 and 256 requests
# at once. Run after bench/gpu_run.sh, as its own command (about 8 minutes; each part has a hard stop).
# Usage on the GPU host: bash bench/gpu_moe.sh
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
cd "$REPO" || exit 1
for n in 1 64 256; do
  timeout --signal=INT --kill-after=15 ${MOE_TIMEOUT:-150} \
    python3 bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --preset qwen3-30b-a3b --random-on-device \
    --impls pallas --skip-agreement --skip-single-stream --num-requests "$n" --time-budget ${MOE_BUDGET:-110} 2>&1 \
    | tee -a "${OUT:-/tmp}/gpu_moe.log"
done
