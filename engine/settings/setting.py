"""One engine setting (`Setting`: flag, type, default, bounds, CRD field, search range) and
the value rules its table (`kvpilot.engine.settings.table`) shares with the engine: vLLM's derived
defaults (max_num_seqs, max_num_batched_tokens, both doubled by `--performance-mode
throughput`) and vLLM's human-readable integers (`1k`, `1K`, `25.6k`, `auto`).

Torch-free (imports only the standard library), like the table.
Source: vLLM `vllm/engine/arg_utils.py` (`human_readable_int`, `human_readable_int_or_auto`,
`_set_default_max_num_seqs_and_batched_tokens_args`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's _DEFAULT_MAX_NUM_BATCHED_TOKENS
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's SchedulerConfig.DEFAULT_MAX_NUM_SEQS
AUTO_MAX_MODEL_LEN = -1  # `--max-model-len auto` / -1: the longest context the KV cache holds (vLLM)
PERFORMANCE_MODES = ("balanced", "interactivity", "throughput")  # vLLM's --performance-mode
_UNSET = object()


def _mode_factor(performance_mode: str | None) -> int:
    return 2 if performance_mode == "throughput" else 1


def default_max_num_batched_tokens(enable_chunked_prefill: bool, max_model_len: int | None,
                                   performance_mode: str | None = "balanced") -> int | None:
    """The token budget when none is given: 2048 with chunked prefill, else
    max(max_model_len, 2048) so that any prompt fits one step (vLLM's defaults); the 2048
    doubles with performance_mode 'throughput' (vLLM `EngineArgs`, 0.17+). None when
    chunked prefill is off and max_model_len is not known yet (None or auto)."""
    budget = DEFAULT_MAX_NUM_BATCHED_TOKENS * _mode_factor(performance_mode)
    if enable_chunked_prefill:
        return budget
    return None if max_model_len is None or max_model_len < 0 else max(max_model_len, budget)


def default_max_num_seqs(performance_mode: str | None = "balanced") -> int:
    """The sequence cap when none is given: 256, doubled with performance_mode 'throughput'."""
    return DEFAULT_MAX_NUM_SEQS * _mode_factor(performance_mode)


_HUMAN_UNITS = {"k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "t": 1000 ** 4,
                "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def human_readable_int(text: str) -> int:
    """'1k' -> 1000, '1K' -> 1024, '25.6k' -> 25600, '4G' -> 4 GiB, '512' -> 512 (vLLM's
    `human_readable_int`: lower-case units decimal, upper-case binary). Raises ValueError."""
    text = str(text).strip()
    unit = _HUMAN_UNITS.get(text[-1:], None)
    number = text[:-1] if unit else text
    try:
        value = float(number) * unit if unit else int(number)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer (units: k, m, g, t decimal; K, M, G, T binary)") from None
    if unit and not float(value).is_integer():
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def human_readable_int_or_auto(text: str) -> int:
    """`human_readable_int`, and 'auto' or '-1' -> AUTO_MAX_MODEL_LEN (vLLM's
    `human_readable_int_or_auto`, the parser of --max-model-len)."""
    if str(text).strip().lower() in ("auto", "-1"):
        return AUTO_MAX_MODEL_LEN
    return human_readable_int(text)


STRUCTURED_OUTPUTS_KEYS = {"backend": ("auto", "xgrammar"), "disable_any_whitespace": (False, True)}


def structured_outputs_config(text: str) -> str:
    """vLLM's `--structured-outputs-config` JSON, checked and written canonically: `backend`
    (xgrammar, the only one kvpilot has; auto picks it) and `disable_any_whitespace` (JSON
    without free whitespace between tokens, for every request that does not say). Raises
    ValueError naming what is wrong. Source: vLLM `StructuredOutputsConfig`."""
    import json

    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("must be a JSON object")
    for key, value in config.items():
        allowed = STRUCTURED_OUTPUTS_KEYS.get(key)
        if allowed is None:
            raise ValueError(f"{key!r} is not supported; keys: {sorted(STRUCTURED_OUTPUTS_KEYS)}")
        if value not in allowed or type(value) is not type(allowed[0]):
            raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}")
    if config.get("disable_any_whitespace") and config.get("backend", "auto") != "xgrammar":
        # vLLM's StructuredOutputsConfig refuses it (its `vllm serve` exits 2), so kvpilot does too
        raise ValueError('disable_any_whitespace needs "backend": "xgrammar" (vLLM: only supported for the xgrammar '
                         'and guidance backends); add it')
    return json.dumps(config, sort_keys=True)


@dataclass(frozen=True)
class Setting:
    """One engine setting.

    name: the EngineArgs field and argparse dest (snake_case, vLLM's).
    flag: the `vllm serve` flag; booleans also take `--no-<flag>`.
    type: int, float, bool or str. default: the engine's default (None: derived or unset).
    crd: the `spec.engine` field (camelCase), or None when the CRD does not carry it.
    live: can change on a running engine (`POST /admin/scheduler_config`).
    minimum/maximum (exclusive_minimum), choices, pattern: what values are allowed.
    deploy_default: what the CRD, the operator and the tuner use when the engine's default
        depends on the loaded model (unset: `default`).
    server: a flag of the HTTP server, not of EngineArgs.
    crd_help: the CRD's description where it says more than help (unset: help).
    special: values accepted outside the bounds (max_model_len's -1, "auto").
    parse: the command line's parser of a value (unset: type).
    search: the tuner's default search range (low, high), or None (not searched by default).
    crd_default: the CRD's default where it is not deploy_default; None: the CRD gives none and the
        operator fills an absent field by the runtime and devices (kvpilot.api.spec).
    """

    name: str
    flag: str
    type: type
    default: Any
    help: str
    crd: str | None = None
    live: bool = False
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[Any, ...] | None = None
    choices_text: str | None = None
    pattern: str | None = None
    max_length: int | None = None
    short: str | None = None
    metavar: str | None = None
    deploy_default: Any = _UNSET
    server: bool = False
    crd_help: str | None = None
    special: tuple[Any, ...] = ()
    parse: Callable[[str], Any] | None = None
    search: tuple[Any, Any] | None = None
    crd_default: Any = _UNSET

    @property
    def deployed_default(self) -> Any:
        """The value the CRD, operator and tuner assume: deploy_default when set, else default."""
        return self.default if self.deploy_default is _UNSET else self.deploy_default

    @property
    def has_crd_default(self) -> bool:
        """Whether crd_default overrides deployed_default in the CRD (kvpilot.engine.settings.crd_defaults)."""
        return self.crd_default is not _UNSET

    def problem(self, value: Any, name: str | None = None) -> str | None:
        """Why `value` is out of this setting's bounds or choices (named `name`), or None."""
        name = name or self.name
        if value is None or (value in self.special and not isinstance(value, bool)):
            return None
        if self.choices is not None and value not in self.choices:
            allowed = self.choices_text or f"one of {list(self.choices)}"
            return f"{name} {value!r} is not supported; {name} must be {allowed}"
        low, high = self.minimum, self.maximum
        if low is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        too_low = value <= low if self.exclusive_minimum else value < low
        if too_low or (high is not None and value > high):
            return f"{name} must be {self.interval_text()}, got {value}"
        return None

    def interval_text(self) -> str:
        """The allowed interval in words for error messages, e.g. '>= 1 and <= 8', 'in (0, 1]'."""
        low, high = _num(self.minimum), _num(self.maximum) if self.maximum is not None else None
        if self.exclusive_minimum:
            return f"in ({low}, {high}]"
        special = "".join(f" (or {_num(v)})" for v in self.special)
        return f">= {low}" + (f" and <= {high}" if high is not None else "") + special


def _num(value: float) -> str:
    """2.0 -> '2', 0.9 -> '0.9': numbers read as a person would type them."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
