"""kvpilot.engine.settings is the one table of engine settings: the serve parser, EngineArgs,
the live scheduler_config schema and the CRD's CEL rules are derived from it and agree with it
(the dataclasses that carry settings are held to it in test_settings_fields_once.py)."""
from __future__ import annotations

import itertools
import subprocess
import sys

import celpy
import pytest
from celpy import celtypes

from kvpilot.engine import settings
from kvpilot.engine.settings.cli_args import make_serve_parser
from kvpilot.engine.settings import BY_NAME, CRD_FIELDS, RULES, SETTINGS


def test_importing_the_settings_and_the_serve_parser_loads_no_torch():
    code = ("import sys, kvpilot.engine.settings, kvpilot.engine.settings.cli_args, kvpilot.engine.exit_codes; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_setting_is_a_serve_flag_with_its_default_type_and_short_form():
    parser = make_serve_parser()
    actions = {a.dest: a for a in parser._actions}
    for s in SETTINGS:
        action = actions[s.name]
        assert s.flag in action.option_strings and (s.short is None or s.short in action.option_strings)
        assert action.default == s.default, s.name
        if s.type is bool:
            assert "--no-" + s.flag[2:] in action.option_strings
        else:
            assert action.type is (s.parse or s.type)
    ns = parser.parse_args(["-tp", "3", "--no-enable-chunked-prefill", "--swap-space", "2.5"])
    assert (ns.tensor_parallel_size, ns.enable_chunked_prefill, ns.swap_space) == (3, False, 2.5)


@pytest.mark.parametrize("words, expected", [
    (["--max-model-len", "auto"], {"max_model_len": -1}), (["--max-model-len", "-1"], {"max_model_len": -1}),
    (["--max-model-len", "1k"], {"max_model_len": 1000}), (["--max-model-len", "1K"], {"max_model_len": 1024}),
    (["--max-model-len", "25.6k"], {"max_model_len": 25600}),
    (["--kv-cache-memory-bytes", "512M"], {"kv_cache_memory_bytes": 512 << 20}),
    (["--kv-cache-memory-bytes", "1000000"], {"kv_cache_memory_bytes": 1000000}),
    (["--performance-mode", "throughput"], {"performance_mode": "throughput"})])
def test_vllms_newest_flags_parse_as_vllm_spells_them(words, expected):
    ns = make_serve_parser().parse_args(words)
    assert {k: getattr(ns, k) for k in expected} == expected


@pytest.mark.parametrize("words", [["--max-model-len", "big"], ["--max-model-len", "1.5"],
                                   ["--kv-cache-memory-bytes", "lots"], ["--performance-mode", "fast"]])
def test_bad_values_of_the_new_flags_exit_2_naming_the_flag(words, capsys):
    with pytest.raises(SystemExit) as e:
        make_serve_parser().parse_args(words)
    assert e.value.code == 2 and words[0] in capsys.readouterr().err


def test_max_model_len_auto_is_the_only_value_below_the_minimum():
    assert settings.problems({"max_model_len": -1}) == []
    assert settings.problems({"max_model_len": 8}) == ["max_model_len must be >= 16 and <= 1048576 (or -1), got 8"]
    assert settings.problems({"kv_cache_memory_bytes": 0}) == ["kv_cache_memory_bytes must be >= 1, got 0"]


@pytest.mark.parametrize("mode, chunked, max_model_len, seqs, budget", [
    ("balanced", True, 4096, 256, 2048), ("interactivity", True, 4096, 256, 2048),
    ("throughput", True, 4096, 512, 4096), ("throughput", False, 8192, 512, 8192),
    ("throughput", False, 1024, 512, 4096)])
def test_throughput_mode_doubles_the_default_limits_as_vllm_does(mode, chunked, max_model_len, seqs, budget):
    assert settings.default_max_num_seqs(mode) == seqs
    assert settings.default_max_num_batched_tokens(chunked, max_model_len, mode) == budget


def test_live_settings_are_the_admin_schema_and_what_the_engine_changes_live():
    from kvpilot.engine.entrypoints.openai.protocol import SchedulerConfigUpdate

    assert tuple(SchedulerConfigUpdate.model_fields) == settings.LIVE_SETTINGS
    assert set(settings.LIVE_SETTINGS) == {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                                           "preemption_mode"}
    with pytest.raises(ValueError):
        SchedulerConfigUpdate(preemption_mode="drop")


@pytest.mark.parametrize("chunked, max_model_len, expected", [
    (True, 8192, 2048), (False, 1024, 2048), (False, 8192, 8192), (False, None, None)])
def test_the_derived_budget_default_is_vllms(chunked, max_model_len, expected):
    assert settings.default_max_num_batched_tokens(chunked, max_model_len) == expected


def test_deploy_defaults_differ_from_the_engine_only_where_the_model_decides():
    deployed = settings.deploy_defaults()
    differs = {s.name for s in SETTINGS if deployed[s.name] != s.default}
    assert differs == {"max_model_len", "max_num_seqs", "max_num_batched_tokens", "show_hidden_metrics_for_version",
                       "performance_mode",  # unset in a spec: no flag, so vLLM images before 0.17 start
                       "enable_auto_tool_choice"}  # unset: no flag (vLLM's has no --no- form)
    assert deployed["max_num_batched_tokens"] == 2048 and deployed["max_num_seqs"] == 256


def test_flags_render_in_the_table_order_and_parse_back():
    values = {"max_num_seqs": 8, "enable_chunked_prefill": False, "gpu_memory_utilization": 0.85,
              "swap_space": 2.0, "tensor_parallel_size": 1, "attention_backend": None}
    words = settings.to_flags(values)
    assert words == ["--max-num-seqs", "8", "--gpu-memory-utilization", "0.85", "--no-enable-chunked-prefill",
                     "--tensor-parallel-size", "1", "--swap-space", "2"]
    ns = make_serve_parser().parse_args(words)
    assert {k: getattr(ns, k) for k in values if values[k] is not None} == {k: v for k, v in values.items()
                                                                           if v is not None}


@pytest.mark.parametrize("values, fragment", [
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1 and <= 4096, got 0"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in (0, 1]"),
    ({"block_size": 24}, "block_size must be a power of two"),
    ({"dtype": "int8"}, "dtype 'int8' is not supported"),
    ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens (8) must be >= max_num_seqs (16)"),
    ({"preemption_mode": "swap", "swap_space": 0.0}, "preemption_mode swap needs swap_space > 0"),
])
def test_problems_name_the_setting_and_what_to_change(values, fragment):
    found = settings.problems(values)
    assert len(found) == 1 and fragment in found[0]
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        settings.check(values)


def test_rules_spell_settings_as_the_caller_does():
    values = {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 1024}
    (message,) = settings.rule_problems(values, CRD_FIELDS.get)
    assert message.startswith("maxNumBatchedTokens (512) is smaller than maxModelLen (1024) with chunked "
                              "prefill off (enableChunkedPrefill false)")
    assert settings.rule_problems({"max_num_batched_tokens": 8}) == []  # a rule missing a value is skipped


def _cel_value(value):
    return celtypes.DoubleType(value) if isinstance(value, float) else celpy.json_to_cel(value)


GRID = {"max_num_batched_tokens": [64, 2048], "max_num_seqs": [32, 256], "max_model_len": [1024, 4096],
        "enable_chunked_prefill": [True, False], "preemption_mode": ["recompute", "swap"], "swap_space": [0.0, 4.0],
        "enable_auto_tool_choice": [True, False, None], "tool_call_parser": [None, "hermes"]}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.field)
def test_each_rules_cel_agrees_with_its_python_check(rule):
    env = celpy.Environment()
    program = env.program(env.compile(rule.cel))
    names = rule.names + rule.optional
    for combo in itertools.product(*(GRID[n] for n in names)):
        values = dict(zip(names, combo))
        # an unset field is absent from spec.engine, and the Python rule is skipped without it
        engine = celtypes.MapType({celtypes.StringType(CRD_FIELDS[k]): _cel_value(v)
                                   for k, v in values.items() if v is not None})
        expected = rule.check(values) if all(values[n] is not None for n in rule.names) else True
        assert bool(program.evaluate({"self": engine})) == expected, values
        assert set(names) <= BY_NAME.keys() and rule.field in rule.names


def _nested(paths: dict[str, str], values: dict) -> celtypes.MapType:
    """spec as CEL sees it: each value at its dotted path (parallelism.nnodes), unset ones absent."""
    tree: dict = {}
    for name, value in values.items():
        *parents, leaf = paths[name].split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return celpy.json_to_cel(tree)


@pytest.mark.parametrize("rule", settings.SPEC_RULES, ids=lambda r: r.field)
def test_each_spec_rules_cel_agrees_with_its_python_check(rule):
    """The rules over spec (nnodes, at spec.parallelism): rule.cel reads settings at SPEC_PATHS."""
    env = celpy.Environment()
    program = env.program(env.compile(rule.cel))
    grid = {"nnodes": [1, 2, 3, 4, 6], "tensor_parallel_size": [1, 2, 3], "pipeline_parallel_size": [1, 2, 4]}
    for combo in itertools.product(*(grid[n] for n in rule.names)):
        values = dict(zip(rule.names, combo))
        assert bool(program.evaluate({"self": _nested(settings.SPEC_PATHS, values)})) == rule.check(values), values
    assert rule.on == "spec" and set(rule.names) <= BY_NAME.keys() and rule.field in rule.names


def test_nnodes_divides_is_the_nnodes_rule():
    """One predicate: the rule's check, the engine's node_ranks and ParallelConfig apply it."""
    from kvpilot.engine.config import ParallelConfig
    assert settings.NNODES_RULE in settings.SPEC_RULES and settings.NNODES_RULE not in RULES
    for world, nnodes in itertools.product(range(1, 9), range(0, 9)):
        ok = settings.nnodes_divides(world, nnodes)
        assert ok == (nnodes >= 1 and world % nnodes == 0)
        if nnodes >= 1:
            assert settings.NNODES_RULE.check({"nnodes": nnodes, "tensor_parallel_size": world,
                                               "pipeline_parallel_size": 1}) == ok
            try:
                ParallelConfig(world, 1, nnodes=nnodes)
                accepted = True
            except ValueError:
                accepted = False
            assert accepted == ok, (world, nnodes)
    message = settings.NNODES_RULE.message(lambda key: settings.SPEC_PATHS[key.rstrip(":")])
    assert message.startswith("parallelism.nnodes must divide engine.tensorParallelSize x engine.pipelineParallelSize")
