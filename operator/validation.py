"""Checks a spec needs beyond the CRD schema: ones that need the model's shape, and the
engine settings' bounds and rules (kvpilot.engine.settings) again for clusters that do not
run the CRD's schema and CEL rules.

A failed check is an InvalidSpec with a CamelCase reason; the operator shows it as the
Failed condition and creates no children.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.api.models import BUILTIN_MODELS, builtin_model, is_builtin
from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.api.vllm import VLLM_CPU_BLOCK_SIZE_MULTIPLE, VLLM_CPU_DEFAULT_BLOCK_SIZE, VLLM_VERSION
from kvpilot.engine import settings

from kvpilot.operator.render.builders import OPERATOR_ENV
from kvpilot.operator.render.engine_args import engine_settings
from kvpilot.operator.render.extra_args import extra_args_problem


class InvalidSpec(ValueError):
    """A spec the schema admits but that cannot run. reason is a CamelCase word."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


# What parsing, validating or the admin's policy raise for a spec that cannot run
SPEC_ERRORS = (InvalidSpec, ValueError, TypeError)


def runnable_spec(body: Mapping[str, Any], policy: Any) -> InferenceServiceSpec:
    """The resource's spec, parsed (InferenceServiceSpec.from_dict), validated and checked against
    the cluster admin's policy (operator.policy.Policy.check). Raises one of SPEC_ERRORS when it
    cannot run."""
    spec = InferenceServiceSpec.from_dict(body.get("spec") or {})
    validate(spec)
    policy.check(spec)
    return spec


def validate(spec: InferenceServiceSpec) -> None:
    """Raise InvalidSpec for the first problem found; return None when the spec can run."""
    engine = spec.engine
    problems = settings.problems(engine_settings(engine), spell=lambda name: settings.CRD_FIELDS.get(name, name))
    if problems:
        raise InvalidSpec("InvalidEngineArgs", problems[0])
    if engine.runtime == "vllm":
        _validate_vllm(spec)
    if not settings.nnodes_divides(engine.world_size, spec.nnodes):  # the CRD's NNODES_RULE
        raise InvalidSpec("InvalidParallelism", (
            f"parallelism.nnodes {spec.nnodes} does not divide tensorParallelSize x pipelineParallelSize = "
            f"{engine.world_size} (each pod of a group runs the same number of ranks); use a divisor of "
            f"{engine.world_size}"))
    if is_builtin(spec.model.source):
        _validate_builtin(spec)
    reserved = sorted({name for name, _ in engine.env} & OPERATOR_ENV)
    if reserved:
        raise InvalidSpec("ReservedEnv", (
            f"spec.engine.env sets {', '.join(reserved)}, which the operator sets itself (the API key comes "
            "from spec.engine.apiKeySecret, profiling from the operator's own fields); remove them"))
    problem = extra_args_problem(engine.runtime, engine.extraArgs, spec.model.source)
    if problem:
        raise InvalidSpec("ConflictingArgs", problem)


def _validate_vllm(spec: InferenceServiceSpec) -> None:
    """What the pinned upstream vLLM (kvpilot.api.vllm) cannot honour: a setting it no longer has,
    set to anything but its default (the operator renders no flag for it), a KV block size its CPU
    attention cannot take, and a builtin:// model on GPUs (only the kvpilot vLLM CPU image bakes it in)."""
    values, defaults = engine_settings(spec.engine), settings.deploy_defaults()
    for name, why in settings.NOT_IN_VLLM.items():
        if values[name] != defaults[name]:
            field = settings.CRD_FIELDS[name]
            raise InvalidSpec("UnsupportedByVLLM", (
                f"spec.engine.{field} {values[name]!r} cannot be honoured by runtime vllm "
                f"(vLLM {VLLM_VERSION}): {why}; leave {field} at {defaults[name]!r} or use runtime kvpilot"))
    if not spec.resources.gpu and spec.engine.blockSize % VLLM_CPU_BLOCK_SIZE_MULTIPLE:
        raise InvalidSpec("UnsupportedByVLLM", (
            f"spec.engine.blockSize {spec.engine.blockSize} cannot run on vLLM {VLLM_VERSION} for CPUs: its CPU "
            f"attention takes multiples of {VLLM_CPU_BLOCK_SIZE_MULTIPLE} tokens; set blockSize: "
            f"{VLLM_CPU_DEFAULT_BLOCK_SIZE} (vLLM's default on CPU)"))
    if is_builtin(spec.model.source) and spec.resources.gpu:
        raise InvalidSpec("UnsupportedModel", (
            f"runtime vllm on GPUs cannot load {spec.model.source}: only the kvpilot vLLM CPU image bakes the "
            "builtin models in; give a model path (model.volumeClaim) or use runtime kvpilot"))


def _validate_builtin(spec: InferenceServiceSpec) -> None:
    engine = spec.engine
    shape = builtin_model(spec.model.source)
    if shape is None:
        known = ", ".join(f"builtin://{name}" for name in sorted(BUILTIN_MODELS))
        raise InvalidSpec("UnknownModel", f"unknown builtin model {spec.model.source!r}; known: {known}")
    tp = engine.tensorParallelSize
    if shape.num_heads % tp or shape.num_kv_heads % tp:
        divisors = [d for d in range(1, shape.num_kv_heads + 1)
                    if shape.num_heads % d == 0 and shape.num_kv_heads % d == 0]
        raise InvalidSpec("InvalidParallelism", (
            f"tensorParallelSize {tp} does not divide {shape.name}'s {shape.num_heads} attention "
            f"heads and {shape.num_kv_heads} KV heads; use one of {divisors}"))
    if engine.pipelineParallelSize > shape.num_layers:
        raise InvalidSpec("InvalidParallelism", (
            f"pipelineParallelSize {engine.pipelineParallelSize} exceeds {shape.name}'s "
            f"{shape.num_layers} layers"))
    if engine.maxModelLen > shape.max_position_embeddings:
        raise InvalidSpec("ModelLenTooLong", (
            f"maxModelLen {engine.maxModelLen} exceeds {shape.name}'s context of "
            f"{shape.max_position_embeddings} tokens"))
