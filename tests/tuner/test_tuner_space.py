"""Search space and feasibility: bounds, the engine's rules, and the KV-cache arithmetic."""
from __future__ import annotations

import optuna
import pytest

from kvpilot.engine.config import ModelConfig
from kvpilot.engine.memory import GiB
from kvpilot.tuner.search import feasibility
from kvpilot.tuner.search.feasibility import Hardware, check, resolve_model
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace

SMOL = resolve_model("smollm2-135m-instruct")


def test_builtin_shape_becomes_the_engine_model_config_with_its_parameter_count():
    assert (SMOL.num_layers, SMOL.num_heads, SMOL.num_kv_heads, SMOL.head_dim) == (30, 9, 3, 64)
    assert SMOL.intermediate_size == 1536  # SmolLM2-135M's config.json
    assert SMOL.num_params() == 134_515_008
    assert SMOL.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2


def test_batched_token_choices_are_powers_of_two_in_bounds_plus_max_model_len_and_default():
    base = EngineSettings(max_model_len=1000, max_num_batched_tokens=3000)
    space = SearchSpace(max_num_batched_tokens=(256, 4096))
    assert space.batched_tokens_choices(base) == [256, 512, 1000, 1024, 2048, 3000, 4096]
    chunked_only = SearchSpace(max_num_batched_tokens=(256, 4096), enable_chunked_prefill=(True,))
    assert 1000 not in chunked_only.batched_tokens_choices(base)


def test_parallel_choices_fit_the_devices_and_divide_heads_and_layers():
    space = SearchSpace(parallel=True, num_devices=4)
    # 9 heads / 3 KV heads: tp in {1, 3}; 30 layers: pp in {1, 2, 3} (4 does not divide 30)
    assert space.parallel_choices(SMOL) == ["1x1", "1x2", "1x3", "3x1"]


def test_defaults_outside_the_bounds_widen_them_so_trial_zero_can_be_enqueued():
    base = EngineSettings(max_num_seqs=256)
    space = SearchSpace(max_num_seqs=(4, 64)).bounds_with(base)
    assert space.max_num_seqs == (4, 256)


def test_suggest_and_params_of_are_inverse():
    base = EngineSettings(max_model_len=1024)
    space = SearchSpace(gpu_memory_utilization=(0.5, 0.95), block_size=(16, 32), parallel=True, num_devices=3)
    target = base.replace(max_num_batched_tokens=512, max_num_seqs=16, gpu_memory_utilization=0.7,
                          enable_chunked_prefill=True, block_size=32, tensor_parallel_size=3)
    study = optuna.create_study(directions=["maximize"])
    study.enqueue_trial(space.params_of(target, SMOL))
    assert space.suggest(study.ask(), base, SMOL) == target


def test_random_suggestions_stay_within_bounds():
    base = EngineSettings(max_model_len=1024)
    space = SearchSpace(max_num_batched_tokens=(128, 2048), max_num_seqs=(2, 64))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(30):
        s = space.suggest(study.ask(), base, SMOL)
        assert 2 <= s.max_num_seqs <= 256  # widened to the default 256
        assert s.max_num_batched_tokens in space.batched_tokens_choices(base)


@pytest.mark.parametrize("changes, words", [
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "must be >= max_num_seqs"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512}, "smaller than max_model_len"),
    ({"tensor_parallel_size": 2}, "must divide"),
    ({"block_size": 24}, "block_size"),
])
def test_engine_rule_breaks_are_infeasible_with_the_engines_message(changes, words):
    verdict = check(EngineSettings(max_model_len=1024).replace(**changes), SMOL, Hardware(64 * GiB, num_devices=4))
    assert not verdict.feasible and words in verdict.reason


def test_parallel_sizes_beyond_the_devices_are_infeasible():
    verdict = check(EngineSettings(tensor_parallel_size=3), SMOL, Hardware(64 * GiB, num_devices=2))
    assert not verdict.feasible and "exceeds the 2 available" in verdict.reason


def test_kv_cache_prediction_uses_the_engine_formula():
    s = EngineSettings(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=8, gpu_memory_utilization=0.5)
    hw = Hardware(device_memory_bytes=2 * GiB)
    verdict = check(s, SMOL, hw)
    weights = SMOL.num_params() * 2
    activation = feasibility.estimate_activation_bytes(SMOL, 256, 8)
    expected = (int(2 * GiB * 0.5) - weights - activation) // (16 * SMOL.kv_bytes_per_token())
    assert verdict.feasible and verdict.num_blocks == expected
    assert verdict.max_concurrency == pytest.approx(expected * 16 / 1024)


def test_setting_that_cannot_fit_one_max_model_len_sequence_is_infeasible():
    # 0.3 GiB x 0.9 leaves ~10 MB after SmolLM2's 269 MB of bf16 weights: not 8192 tokens (2.9 GB... of KV)
    verdict = check(EngineSettings(max_model_len=8192), SMOL, Hardware(device_memory_bytes=int(0.3 * GiB)))
    assert not verdict.feasible and "KV blocks" in verdict.reason
    # and with more memory the same setting fits
    assert check(EngineSettings(max_model_len=8192), SMOL, Hardware(device_memory_bytes=4 * GiB)).feasible


def test_num_gpu_blocks_override_sizes_the_cache_exactly():
    hw = Hardware(device_memory_bytes=1, num_gpu_blocks_override=64)
    assert check(EngineSettings(max_model_len=1024), SMOL, hw).feasible  # 64 x 16 = 1024 tokens
    verdict = check(EngineSettings(max_model_len=2048), SMOL, hw)
    assert not verdict.feasible and "128 KV blocks" in verdict.reason


def test_settings_spellings():
    s = EngineSettings(max_model_len=1024, max_num_seqs=8, enable_chunked_prefill=False)
    assert s.max_num_batched_tokens == 2048  # SchedulerConfig's default without chunking
    flags = s.to_flags()
    assert flags[flags.index("--max-num-seqs") + 1] == "8" and "--no-enable-chunked-prefill" in flags
    assert EngineSettings.from_engine_spec(s.to_engine_spec()) == s
    assert s.live_changes(s.replace(max_num_seqs=4, enable_chunked_prefill=True)) == \
        {"max_num_seqs": 4, "enable_chunked_prefill": True}
    assert s.live_changes(s.replace(gpu_memory_utilization=0.5)) is None


def test_model_config_from_a_hf_directory(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512}))
    model = resolve_model(str(tmp_path))
    assert isinstance(model, ModelConfig) and model.num_kv_heads == 2 and model.head_dim == 16
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model(str(tmp_path / "missing"))


def test_power_of_two_concurrency_and_the_grid_cover_the_same_points():
    base = EngineSettings(max_model_len=512, max_num_seqs=256, max_num_batched_tokens=2048)
    space = SearchSpace(max_num_batched_tokens=(128, 1024), max_num_seqs=(2, 16), enable_chunked_prefill=(True,),
                        max_num_seqs_pow2=True).bounds_with(base)
    assert space.seqs_choices(base) == [2, 4, 8, 16, 256]
    grid = space.grid(base)
    assert len(grid) == 5 * 5 and base in grid
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        assert space.suggest(study.ask(), base, SMOL) in grid


def test_a_spec_without_block_size_reads_as_the_operator_deploys_it():
    """The tuner reads an absent spec.engine.blockSize as the operator fills it (kvpilot.api.spec),
    so a trial on runtime vllm on CPUs keeps KV blocks vLLM's CPU attention takes."""
    vllm_cpu = {"engine": {"runtime": "vllm"}}
    assert EngineSettings.from_spec(vllm_cpu).block_size == 128
    assert EngineSettings.from_spec({**vllm_cpu, "resources": {"gpu": True}}).block_size == 16
    assert EngineSettings.from_spec({"engine": {}}).block_size == 16
    assert EngineSettings.from_spec({"engine": {"runtime": "vllm", "blockSize": 64}}).block_size == 64
    assert EngineSettings.from_spec(vllm_cpu).to_engine_spec()["blockSize"] == 128  # a trial's patch says so
