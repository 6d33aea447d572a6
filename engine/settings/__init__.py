"""The engine settings, one floor below everything that reads them: the engine core, the
HTTP server (`engine/entrypoints`), the operator, the tuner, `api/` and the CRD generator.

- `table`: every setting once (flag, `spec.engine` field, type, default, bounds, live or not,
  search range) and the rules between settings; its names are re-exported here, so
  `from kvpilot.engine.settings import BY_NAME` is the way in.
- `setting`: the `Setting` type and the value rules it shares with the engine (vLLM's derived
  defaults, its human-readable integers).
- `cli_args`: `kvpilot serve`'s argument parser built from the table, which the engine
  (`EngineArgs.add_cli_args`), the server and the operator (`extraArgs`) all use.
- `env`: the names of the environment variables kvpilot reads or sets (KVPILOT_*, and the
  VLLM_* ones it reads or sets for vLLM), once.

Standard library only, no torch (import-linter contract settings-is-a-leaf), so the operator
and the tuner load it without the engine.
"""

from kvpilot.engine.settings.setting import (
    AUTO_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    PERFORMANCE_MODES,
    STRUCTURED_OUTPUTS_KEYS,
    Setting,
    default_max_num_batched_tokens,
    default_max_num_seqs,
    human_readable_int,
    human_readable_int_or_auto,
    structured_outputs_config,
)
from kvpilot.engine.settings.table import (
    ATTENTION_BACKENDS,
    BY_CRD,
    BY_NAME,
    CRD_FIELDS,
    ENGINE_SETTINGS,
    LIVE_SETTINGS,
    NNODES_RULE,
    NOT_IN_VLLM,
    RULES,
    RUNTIMES,
    SEARCH_RANGES,
    SPEC_PATHS,
    SPEC_RULES,
    TUNED_SETTINGS,
    SETTINGS,
    Rule,
    check,
    crd_defaults,
    deploy_defaults,
    flag_value,
    flag_words,
    nnodes_divides,
    problems,
    resolve_quantization,
    rule_problems,
    to_flags,
)

__all__ = [
    "ATTENTION_BACKENDS", "AUTO_MAX_MODEL_LEN", "BY_CRD", "BY_NAME", "CRD_FIELDS", "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS", "ENGINE_SETTINGS", "LIVE_SETTINGS", "NNODES_RULE", "NOT_IN_VLLM", "PERFORMANCE_MODES", "RULES", "RUNTIMES", "SEARCH_RANGES",
    "SPEC_PATHS", "SPEC_RULES", "TUNED_SETTINGS", "SETTINGS", "STRUCTURED_OUTPUTS_KEYS", "Rule", "Setting", "check", "default_max_num_batched_tokens",
    "crd_defaults", "default_max_num_seqs", "deploy_defaults", "flag_value", "flag_words", "human_readable_int",
    "human_readable_int_or_auto", "nnodes_divides", "problems", "resolve_quantization", "rule_problems", "structured_outputs_config",
    "to_flags",
]
