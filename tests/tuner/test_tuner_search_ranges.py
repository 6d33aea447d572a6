"""One table of default search ranges (`kvpilot.engine.settings.SEARCH_RANGES`): `SearchSpace()`,
`kvpilot tune --local`, the in-cluster tuner (the daemon's parsed flags) and the user guide's
table all show the same ranges; this fails when any of them differs. The new knobs of
vLLM 0.17 (performance mode, KV bytes) are opt-in axes that suggest and invert."""
from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from kvpilot.engine import settings
from kvpilot.tuner import cli
from kvpilot.tuner.cluster.daemon import session_args
from kvpilot.tuner.search.feasibility import resolve_model
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace, ranges_markdown

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"
MODEL = resolve_model("smollm2-135m-instruct")


def _ranges(space: SearchSpace) -> dict[str, tuple]:
    return {name: getattr(space, name) for name in settings.SEARCH_RANGES}


def test_the_table_is_derived_from_the_settings_and_holds_the_engine_defaults():
    assert settings.SEARCH_RANGES == {s.name: s.search for s in settings.SETTINGS if s.search}
    defaults = settings.deploy_defaults()
    for name, (low, high) in settings.SEARCH_RANGES.items():
        assert settings.BY_NAME[name].problem(low) is None and settings.BY_NAME[name].problem(high) is None
        assert low <= defaults[name] <= high, name  # the defaults trial lies inside the default space
    assert settings.default_max_num_seqs("throughput") <= settings.SEARCH_RANGES["max_num_seqs"][1]


def test_space_cli_and_in_cluster_tuner_search_the_same_default_ranges():
    local = cli.parse(["--local"])
    cluster = cli.parse(session_args("default", "smollm2", env={}))
    assert _ranges(SearchSpace()) == _ranges(local.space) == _ranges(cluster.space) == settings.SEARCH_RANGES


def test_the_user_guide_prints_the_table():
    assert ranges_markdown() in GUIDE.read_text()
    for name, (low, high) in settings.SEARCH_RANGES.items():
        assert f"| `{name}` | `{settings.BY_NAME[name].flag} LOW:HIGH` | {low} to {high} |" in ranges_markdown()


def test_a_range_given_on_the_command_line_overrides_the_table():
    a = cli.parse(["--local", "--max-num-seqs", "4:32", "--kv-cache-memory-bytes", "8M:64M",
                   "--performance-modes", "balanced,throughput"])
    assert a.space.max_num_seqs == (4, 32)
    assert a.space.max_num_batched_tokens == settings.SEARCH_RANGES["max_num_batched_tokens"]
    assert a.space.kv_cache_memory_bytes == (8 << 20, 64 << 20)
    assert a.space.performance_mode == ("balanced", "throughput")


@pytest.mark.parametrize("argv", [["--local", "--performance-modes", "fast"],
                                  ["--local", "--kv-cache-memory-bytes", "0:8M"]])
def test_bad_new_ranges_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        cli.parse(argv)
    assert e.value.code == 2


def test_performance_mode_and_kv_bytes_suggest_and_invert():
    space = SearchSpace(max_num_batched_tokens=None, max_num_seqs=None, enable_chunked_prefill=(True,),
                        kv_cache_memory_bytes=(4 << 20, 64 << 20), performance_mode=("balanced", "throughput"))
    base = EngineSettings(max_model_len=256, kv_cache_memory_bytes=8 << 20)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(12):
        trial = study.ask()
        s = space.suggest(trial, base, MODEL)
        assert (4 << 20) <= s.kv_cache_memory_bytes <= (64 << 20)
        seen.add(s.performance_mode)
        assert space.params_of(s, MODEL) == trial.params
        study.tell(trial, 1.0)
    assert seen == {"balanced", "throughput"}


def test_throughput_mode_doubles_the_defaults_trials_limits_unless_given():
    assert (EngineSettings(performance_mode="throughput").max_num_seqs,
            EngineSettings(performance_mode="throughput").max_num_batched_tokens) == (512, 4096)
    assert EngineSettings(performance_mode="throughput", max_num_seqs=8).max_num_seqs == 8
    assert (EngineSettings().max_num_seqs, EngineSettings().max_num_batched_tokens) == (256, 2048)
    assert "--performance-mode" not in EngineSettings().to_flags()  # unset: no flag (vLLM < 0.17 starts)
