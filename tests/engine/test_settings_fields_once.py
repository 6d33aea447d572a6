"""A setting's fields are declared once, in kvpilot.engine.settings, and every other place that
names a setting is held to it here.

The dataclasses that carry settings stay dataclasses with fields of their own (STYLE: a frozen
dataclass per concern): `EngineArgs`, the engine's `SchedulerConfig`, `CacheConfig`,
`ParallelConfig` and `EngineConfig`, api's `EngineSpec` (spec.engine, camelCase) and the tuner's
`EngineSettings`. For each, every field that names a setting (in its spelling) must have the
setting's type (or that type or None) and, on an instance built with defaults, the default the
table gives that consumer; every setting the table marks for it must be there (EngineArgs: the
engine's settings, EngineSpec: those with a CRD field, SchedulerConfig: the live ones, the
tuner: the live and the searched ones); where the consumer says so, no other field may pose as
one. The label and key lists that name settings are checked too: `kvpilot:engine_config_info`'s
and `vllm:cache_config_info`'s labels, the tuner's `kvpilot_tuning_settings_info` labels and status.tuning.history keys, and
the tuner's reading of the budget rules' messages. `test_a_drifted_dataclass_is_caught` shows
that each kind of drift fails."""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpilot.api.spec import EngineSpec
from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvpilot.engine.metrics.config_info import cache_config_info_labels, engine_config_info_labels
from kvpilot.engine.settings import (BY_NAME, CRD_FIELDS, ENGINE_SETTINGS, LIVE_SETTINGS, RULES, SEARCH_RANGES,
                                     SETTINGS, Setting, crd_defaults, default_max_num_batched_tokens,
                                     default_max_num_seqs, deploy_defaults, rule_problems)
from kvpilot.api.tuning_metrics import SETTINGS_LABELS
from kvpilot.tuner.cluster.runner import HISTORY_SETTINGS
from kvpilot.tuner.failures import REJECTED, classify
from kvpilot.tuner.search.settings import EngineSettings

MAX_MODEL_LEN = 2048  # the model length the engine's configs are built with here


@dataclass(frozen=True)
class Consumer:
    """A dataclass that carries settings. spell(setting): its field for the setting (None: not
    carried); defaults: what an instance built by make(cls) holds, by setting name (a name left
    out is not checked: the engine resolves it from the model or the device); required: the
    settings it must carry; others: its fields that are no setting (None: any)."""

    cls: type
    spell: Callable[[Setting], str | None]
    defaults: Mapping[str, Any]
    required: frozenset[str] = frozenset()
    others: frozenset[str] | None = None
    make: Callable[[type], Any] = lambda cls: cls()


def _type_text(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


def drift(consumer: Consumer) -> list[str]:
    """How consumer.cls differs from the table, as messages ([] when it agrees)."""
    names = {f.name for f in dataclasses.fields(consumer.cls)}
    hints = typing.get_type_hints(consumer.cls)
    carried = {consumer.spell(s): s for s in SETTINGS if consumer.spell(s) in names}
    instance = consumer.make(consumer.cls)
    found = [f"no field {consumer.spell(BY_NAME[name])} for setting {name}" for name in sorted(consumer.required)
             if consumer.spell(BY_NAME[name]) not in carried]
    if consumer.others is not None:
        found += [f"{name} is no setting of the table" for name in sorted(names - carried.keys() - consumer.others)]
    for name, setting in carried.items():
        members = set(typing.get_args(hints[name])) or {hints[name]}
        if setting.type not in members or not members <= {setting.type, type(None)}:
            found.append(f"{name} is {_type_text(hints[name])}, the table says {setting.type.__name__}")
        value = getattr(instance, name)
        if setting.name in consumer.defaults and value != consumer.defaults[setting.name]:
            found.append(f"{name} defaults to {value!r}, the table to {consumer.defaults[setting.name]!r}")
    return found


def engine_defaults() -> dict[str, Any]:
    """What the engine runs with when a MAX_MODEL_LEN model is given nothing else: the table's
    defaults with the derived limits resolved; those still None are left out (the engine
    resolves them at start: attention backend and device from the machine, the served name
    from the model)."""
    values = {s.name: s.default for s in SETTINGS}
    values.update(max_model_len=MAX_MODEL_LEN, max_num_seqs=default_max_num_seqs(),
                  max_num_batched_tokens=default_max_num_batched_tokens(values["enable_chunked_prefill"],
                                                                        MAX_MODEL_LEN))
    return {name: value for name, value in values.items() if value is not None}


def _model() -> ModelConfig:
    return ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=8, max_position_embeddings=MAX_MODEL_LEN)


def _engine_config(cls: type) -> EngineConfig:
    return cls(model_path="m", model=_model(), cache=CacheConfig(), scheduler=SchedulerConfig(MAX_MODEL_LEN))


def snake(setting: Setting) -> str:
    return setting.name


CONSUMERS = {
    "EngineArgs": Consumer(EngineArgs, lambda s: None if s.server else s.name, {s.name: s.default for s in SETTINGS},
                           required=frozenset(s.name for s in ENGINE_SETTINGS), others=frozenset({"model"})),
    "EngineSpec": Consumer(EngineSpec, lambda s: s.crd, crd_defaults(), required=frozenset(CRD_FIELDS),
                           others=frozenset({"runtime", "image", "imagePullPolicy", "apiKeySecret", "profiling",
                                             "extraArgs", "env"})),
    "EngineSettings": Consumer(EngineSettings, snake, deploy_defaults(),
                               required=frozenset({*LIVE_SETTINGS, *SEARCH_RANGES}), others=frozenset()),
    "SchedulerConfig": Consumer(SchedulerConfig, snake, engine_defaults(), required=frozenset(LIVE_SETTINGS),
                                make=lambda cls: cls(max_model_len=MAX_MODEL_LEN)),
    "CacheConfig": Consumer(CacheConfig, snake, engine_defaults()),
    "ParallelConfig": Consumer(ParallelConfig, snake, engine_defaults()),
    "EngineConfig": Consumer(EngineConfig, snake, engine_defaults(), make=_engine_config),
    # not ModelConfig: the loaded model's shape, whose max_model_len (0: the model's context) and
    # dtype (a torch dtype) are what the engine resolved, not settings
}


@pytest.mark.parametrize("name", CONSUMERS)
def test_each_dataclass_carries_its_settings_as_the_table_declares_them(name):
    consumer = CONSUMERS[name]
    assert {consumer.spell(s) for s in SETTINGS} & {f.name for f in dataclasses.fields(consumer.cls)}, name
    assert drift(consumer) == []


@pytest.mark.parametrize("fields, consumer, expected", [
    # a field renamed by hand: the setting goes missing and the new name is no setting
    ([("maxNumBatchedToken", int, field(default=2048))],
     dict(spell=lambda s: s.crd, defaults=deploy_defaults(), required=frozenset({"max_num_batched_tokens"}),
          others=frozenset()),
     ["no field maxNumBatchedTokens for setting max_num_batched_tokens",
      "maxNumBatchedToken is no setting of the table"]),
    # a default written again by hand, and one that no longer matches
    ([("max_num_seqs", int, field(default=128))], dict(spell=snake, defaults=engine_defaults()),
     ["max_num_seqs defaults to 128, the table to 256"]),
    # a type written again by hand (the default compares equal: 4 == 4.0)
    ([("swap_space", int, field(default=4))], dict(spell=snake, defaults=engine_defaults()),
     ["swap_space is int, the table says float"]),
    ([("enable_chunked_prefill", "int | None", field(default=True))], dict(spell=snake, defaults=engine_defaults()),
     ["enable_chunked_prefill is int | None, the table says bool"]),
    # a setting the table marks for the consumer, left out
    ([("max_num_seqs", "int | None", field(default=None))],
     dict(spell=snake, defaults={}, required=frozenset({"max_num_seqs", "preemption_mode"})),
     ["no field preemption_mode for setting preemption_mode"]),
], ids=["renamed", "default", "type", "optional-type", "missing"])
def test_a_drifted_dataclass_is_caught(fields, consumer, expected):
    drifted = dataclasses.make_dataclass("Drifted", fields, frozen=True)
    assert drift(Consumer(drifted, **consumer)) == expected


def test_config_info_labels_are_settings_and_report_the_live_ones():
    """The tuner confirms a trial by these labels (kvpilot's gauge and vLLM's cache one) and
    skips any it does not find, so a label spelled apart from its setting would silently stop
    the check."""
    config = _engine_config(EngineConfig)
    labels = engine_config_info_labels(config, num_gpu_blocks=1, num_cpu_blocks=2)
    assert labels.keys() - {"num_gpu_blocks", "num_cpu_blocks"} <= BY_NAME.keys()
    assert set(LIVE_SETTINGS) <= labels.keys()
    sections = (config.cache, config.scheduler, config.parallel)
    cache_labels = cache_config_info_labels(config, num_gpu_blocks=1, num_cpu_blocks=2)
    for found in (labels, cache_labels):
        for name in found.keys() & BY_NAME.keys() - {"dtype"}:  # dtype: the resolved one, not --dtype's spelling
            value = next(getattr(s, name) for s in sections if hasattr(s, name))
            assert found[name] == str(value), name
    assert {"block_size", "gpu_memory_utilization", "enable_prefix_caching", "kv_cache_memory_bytes"} <= cache_labels.keys()


def test_the_tuners_labels_and_history_keys_are_its_settings():
    """The exporter and status.tuning.history read a trial's settings (EngineSettings.as_dict()) by
    these names; a name that is not a field would label or show nothing."""
    fields = {f.name for f in dataclasses.fields(EngineSettings)}
    assert set(SETTINGS_LABELS) <= fields and set(HISTORY_SETTINGS) <= fields


@pytest.mark.parametrize("rule", [r for r in RULES if r.field == "max_num_batched_tokens"], ids=lambda r: r.cel)
def test_the_tuners_log_reader_rejects_the_budget_rules_messages(rule):
    """tuner/failures.py reads an engine's log tail (upstream vLLM's, or kvpilot's exiting 1)
    for the budget rules' messages, which spell the setting as the table does."""
    broken = {"max_num_batched_tokens": 8, "max_num_seqs": 16, "enable_chunked_prefill": False, "max_model_len": 1024}
    (message,) = rule_problems({n: broken[n] for n in rule.names})
    assert classify(1, message) == REJECTED, message
