# Sourced by bench/gpu_run.sh and bench/gpu_quant.sh on a GPU host without this repo installed: installs nothing from
# the network (wheels put in .whl/, e.g. gguf's, pure Python, go into /tmp/site), and puts a throwaway `jaxserve`
# package of links on PYTHONPATH in place of `pip install -e .`. Sets REPO.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$REPO"/.whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
SHIM="$(mktemp -d)"
mkdir -p "$SHIM/jaxserve"
for f in "$REPO"/jaxserve/*; do ln -s "$f" "$SHIM/jaxserve/$(basename "$f")"; done
ln -s "$REPO/kernels" "$SHIM/jaxserve/kernels"
ln -s "$REPO/configs" "$SHIM/jaxserve/configs"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
