"""Which weights an engine serves by default: a GGUF model (the builtin SmolLM2, a .gguf path)
loads with `--quantization gguf` on CPU, as vLLM's EngineArgs.create_model_config sets it for a
GGUF file; `--quantization none` keeps the dense (dequantized) weights only; a Hugging Face
directory and a GPU keep the dense weights (engine/settings/table.py resolve_quantization)."""

from __future__ import annotations

import pytest

from kvpilot.api.models import is_gguf_source
from kvpilot.engine import EngineArgs
from kvpilot.engine.settings import resolve_quantization
from kvpilot.engine.memory import GiB
from kvpilot.tuner.search.feasibility import Hardware, check, resolve_model
from kvpilot.tuner.search.settings import EngineSettings

MODEL = "smollm2-135m-instruct"


@pytest.mark.parametrize(("given", "gguf_model", "on_cpu", "want"), [
    (None, True, True, "gguf"),
    (None, True, False, None),
    (None, False, True, None),
    ("none", True, True, None),
    ("gguf", True, True, "gguf"),
])
def test_resolve_quantization(given, gguf_model, on_cpu, want):
    assert resolve_quantization(given, gguf_model, on_cpu) == want


def test_the_builtin_model_loads_with_its_gguf_blocks_unless_told_none():
    config = EngineArgs(MODEL, device="cpu").create_engine_config()
    assert config.quantization == "gguf" and config.quantized_weights_path.endswith(".gguf")
    dense = EngineArgs(MODEL, device="cpu", quantization="none").create_engine_config()
    assert dense.quantization is None and dense.quantized_weights_path is None


def test_a_bad_quantization_names_the_choices():
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(MODEL, device="cpu", quantization="awq").create_engine_config()


@pytest.mark.parametrize(("source", "want"), [
    ("builtin://smollm2-135m-instruct", True), (MODEL, True), ("/models/x.Q4_1.gguf", True),
    ("/models/hf-dir", False), ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", False)])
def test_the_tuner_knows_which_sources_are_gguf(source, want):
    assert is_gguf_source(source) is want


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_tuner_counts_the_blocks_the_engine_holds(dtype):
    # a CPU engine on the builtin GGUF holds its blocks beside the dense weights: fewer KV blocks fit
    settings = EngineSettings(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=8,
                              gpu_memory_utilization=0.5)
    model = resolve_model(MODEL, dtype)
    dense = check(settings, model, Hardware(2 * GiB, shared_memory=True, dtype=dtype))
    gguf = check(settings, model, Hardware(2 * GiB, shared_memory=True, dtype=dtype,
                                           quantization="gguf"))
    assert dense.feasible and gguf.feasible
    assert gguf.num_blocks < dense.num_blocks
