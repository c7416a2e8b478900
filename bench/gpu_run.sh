#!/usr/bin/env bash
# One-shot GPU check: the kernels (bench/gpu_check.sh), then the whole engine (bench/gpu_engine.py), on a host
# with one GPU and JAX for CUDA but without this repo installed. Installs nothing from the network: wheels put in
# .whl/ (e.g. gguf's, pure Python) are installed into /tmp/site, and a throwaway `jaxserve` package of links stands
# in for `pip install -e .`. Needs .gpu/tokenizer.gguf (python bench/gpu_engine.py --write-tokenizer .gpu).
# Usage on the GPU host: bash bench/gpu_run.sh   (about 8 minutes; each part has a hard stop)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$REPO"/.whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
KERNEL_BUDGET=${KERNEL_BUDGET:-200} bash "$REPO/bench/gpu_check.sh"
SHIM="$(mktemp -d)"
mkdir -p "$SHIM/jaxserve"
for f in "$REPO"/jaxserve/*; do ln -s "$f" "$SHIM/jaxserve/$(basename "$f")"; done
ln -s "$REPO/kernels" "$SHIM/jaxserve/kernels"
ln -s "$REPO/configs" "$SHIM/jaxserve/configs"
cd "$REPO" && PYTHONPATH="$SHIM:$PYTHONPATH" timeout --signal=INT --kill-after=15 ${ENGINE_TIMEOUT:-270} \
  python3 bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --time-budget ${ENGINE_BUDGET:-200} 2>&1 \
  | tee -a "${OUT:-/tmp}/gpu_engine.log"
