"""bench/gpu_engine.py's step floor (``--step-truth``) against numbers worked out by hand."""

import importlib.util
import sys
from pathlib import Path

import pytest

from jaxserve.config import load_preset

_PATH = Path(__file__).resolve().parents[1] / "bench" / "gpu_engine.py"
_spec = importlib.util.spec_from_file_location("bench_gpu_engine", _PATH)
gpu_engine = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_engine  # dataclasses look their module up there
_spec.loader.exec_module(gpu_engine)


def test_step_floor_smollm2_tied_embeddings():
    # SmolLM2-135M: 134,515,008 parameters (embedding 49,152 x 576 = 28,311,552, tied as the head), bf16: every
    # weight byte is read (the table is the head). KV per token: 30 layers x 3 KV heads x (64 + 64) x 2 B = 23,040.
    floor = gpu_engine.StepFloor.of(load_preset("smollm2-135m"))
    assert floor.head_params == 28_311_552
    assert floor.layer_params == 134_515_008 - 28_311_552
    # a decode step of 4 sequences with 100 cached tokens each
    assert floor.bytes(4, 400) == 134_515_008 * 2 + 400 * 23_040 == 278_246_016
    assert floor.seconds((1e12, 1e15), 4, 4, 4, 400) == pytest.approx(278_246_016 / 1e12)
    # a mixed step: 1,000 prompt tokens of 4 new sequences (nothing cached), each sampling a row; compute-bound
    flops = 2 * (106_203_456 * 1000 + 28_311_552 * 4)
    assert floor.flops(1000, 4) == flops == 212_633_404_416
    assert floor.seconds((1e12, 1e14), 4, 1000, 4, 0) == pytest.approx(flops / 1e14)


def test_step_floor_llama3_8b_reads_the_embedding_by_rows():
    # Llama-3-8B: 8,030,261,248 parameters, its own output head: the 128,256 x 4,096 embedding table (1,050,673,152
    # bytes in bf16) is looked up, not read. KV per token: 32 layers x 8 KV heads x 256 x 2 B = 131,072.
    floor = gpu_engine.StepFloor.of(load_preset("llama-3-8b"))
    table = 128_256 * 4_096
    assert floor.head_params == table
    assert floor.layer_params == 8_030_261_248 - 2 * table
    assert floor.bytes(64, 64 * 1536) == 8_030_261_248 * 2 - 2 * table + 64 * 1536 * 131_072
    # H100: 64 x 1,536 tokens of context -> 28.0 GB per decode step -> 8.4 ms
    assert floor.seconds(gpu_engine.gpu_peaks("NVIDIA H100 80GB HBM3"), 64, 64, 64, 64 * 1536) == pytest.approx(
        (8_030_261_248 * 2 - 2 * table + 64 * 1536 * 131_072) / 3.35e12
    )


def test_gpu_peaks_by_device_kind():
    assert gpu_engine.gpu_peaks("NVIDIA H100 80GB HBM3") == (3.35e12, 989e12)
    assert gpu_engine.gpu_peaks("NVIDIA H200") == (4.8e12, 989e12)
    assert gpu_engine.gpu_peaks("NVIDIA A100-SXM4-80GB") == (2.0e12, 312e12)
    assert gpu_engine.gpu_peaks("NVIDIA A100-SXM4-40GB") is None
    assert gpu_engine.gpu_peaks("cpu") is None
