#!/usr/bin/env bash
# One-shot GPU check of jaxserve's kernels on a host with one GPU that already
# has JAX with CUDA. Installs nothing and does not pip-install this repo: it lays out a throwaway
# `jaxserve` package of links to the repo's jaxserve/, kernels/ and configs/, so `import jaxserve.kernels` needs
# nothing but jax and numpy. Runs, compiled on the GPU:
#   1. correctness of the Triton kernels (attention, KV write) vs the reference, on NaN-poisoned edge-case
#      batches, float32 and bfloat16, bfloat16 queries over fp8 and int8 pages;
#   2. decode timings, Llama-3-8B heads (32 q, 8 kv, head_dim 128, bf16, page 16), batch 1/32/128 x
#      context 512/2048/8192, ours vs the jnp reference, as bytes/s of K/V against the measured copy
#      bandwidth; then batch 64 x 2048 with JAX's own pallas.ops.gpu.paged_attention for comparison.
# Each case is isolated (an error is printed and the rest go on); the summary table is printed last.
# Usage: bash bench/gpu_check.sh            (about 3-6 minutes; hard stop at 7.5)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/jaxserve"
for f in "$REPO"/jaxserve/*; do ln -s "$f" "$SHIM/jaxserve/$(basename "$f")"; done
ln -s "$REPO/kernels" "$SHIM/jaxserve/kernels"
ln -s "$REPO/configs" "$SHIM/jaxserve/configs"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
LOG="${OUT:-$SHIM}/gpu_check.log"

{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv 2>/dev/null || true
  python3 -c "import jax, jaxserve.kernels as k; print('jax', jax.__version__, jax.devices(), k.__file__)"
} 2>&1 | tee -a "$LOG"

timeout --signal=INT --kill-after=15 $(( ${KERNEL_BUDGET:-390} + 60 )) python3 "$REPO/bench/kernels.py" \
  --check \
  --impls pallas,reference \
  --batches 1,32,128 \
  --contexts 512,2048,8192 \
  --extra-cases 64x2048 \
  --extra-impls pallas,xla,jax_paged \
  --iters 20 \
  --copy-mb 2048 \
  --time-budget ${KERNEL_BUDGET:-390} \
  2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
echo "== exit status $status (log: $LOG)"
exit "$status"
