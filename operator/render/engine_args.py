"""Renders spec.engine as a `vllm serve`-style command line, and hashes the configuration.

kvpilot's engine and upstream vLLM take the same flags, so runtime mostly picks the program:
`kvpilot serve MODEL ...` or `vllm serve MODEL ...`. The flags come from
`kvpilot.engine.settings` (every setting, explicitly, so the pod never depends on a default),
less those the pinned vLLM (kvpilot.api.vllm) no longer takes under runtime vllm
(settings.NOT_IN_VLLM); a builtin:// model is the directory the image bakes it in for vLLM.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from kvpilot.api.models import image_model_path, is_builtin
from kvpilot.api.spec import EngineSpec, InferenceServiceSpec
from kvpilot.engine import settings
from kvpilot.engine.settings.env import KVPILOT_ADMIN_TOKEN, VLLM_API_KEY

# The engine reads its API key from this variable (as vLLM does); extraArgs may not repeat
# any flag rendered here (operator/render/extra_args.py).
API_KEY_ENV = VLLM_API_KEY
ADMIN_TOKEN_ENV = KVPILOT_ADMIN_TOKEN  # the control routes' own token, from the operator's Secret

PROGRAMS = {"kvpilot": ["kvpilot", "serve"], "vllm": ["vllm", "serve"]}
ADMIN_ROUTES_FLAG = "--enable-admin-routes"  # kvpilot serve's control routes (not a setting: a server switch)


def engine_settings(engine: EngineSpec) -> dict[str, Any]:
    """spec.engine's settings by their engine names (kvpilot.engine.settings.CRD_FIELDS); an
    empty showHiddenMetricsForVersion is None (no flag)."""
    values = {name: getattr(engine, field) for name, field in settings.CRD_FIELDS.items()}
    values["show_hidden_metrics_for_version"] = values["show_hidden_metrics_for_version"] or None
    return values


def render_engine_args(engine: EngineSpec) -> list[str]:
    """The flags after `serve MODEL`, in the settings table's order, then extraArgs verbatim.

    No secret is ever a flag: the API key reaches the engine as $VLLM_API_KEY from the Secret
    (a flag would show in `ps` inside the pod, and in the ConfigMap and status)."""
    args = settings.to_flags(engine_settings(engine), runtime=engine.runtime)
    if engine.runtime == "kvpilot":  # behind $KVPILOT_ADMIN_TOKEN; upstream vLLM has no such flag
        args.append(ADMIN_ROUTES_FLAG)
    return args + list(engine.extraArgs)


def model_argument(spec: InferenceServiceSpec) -> str:
    """What `serve` loads: spec.model.source, except a builtin:// model under runtime vllm, which
    is the directory the kvpilot vLLM CPU image bakes it in (vLLM knows no builtin:// scheme;
    kvpilot serve reads the same directory through KVPILOT_BUILTIN_MODELS_DIR)."""
    source = spec.model.source
    return image_model_path(source) if spec.engine.runtime == "vllm" and is_builtin(source) else source


def engine_command(spec: InferenceServiceSpec) -> list[str]:
    """The whole command line: program, `serve`, the model source, `--served-model-name`, then
    the flags. The served name is spec.model.name (or the source's last part), so that clients,
    the tuner's requests and its `model_name` metric selectors all use the same name, as
    `vllm serve --served-model-name` does."""
    return (PROGRAMS[spec.engine.runtime] + [model_argument(spec)]
            + settings.flag_words("served_model_name", spec.model.display_name) + render_engine_args(spec.engine))


def config_hash(config: dict[str, Any]) -> str:
    """A short stable hash of a JSON-able configuration (sorted keys), 16 hex digits."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
