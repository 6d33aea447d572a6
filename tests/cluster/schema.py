"""What the API server does with a custom resource's openAPIV3Schema on every write:
defaulting, pruning of unknown fields, OpenAPI validation and CEL rules
(x-kubernetes-validations, evaluated with cel-python), in that order."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema
from celpy import celtypes


@dataclass(frozen=True)
class Cause:
    """One field error, as in a 422 Status's details.causes."""

    field: str
    message: str
    reason: str = "FieldValueInvalid"

    def render(self) -> str:
        return f"{self.field}: {self.message}"


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill in `default`s top-down: a defaulted object gets its own properties' defaults too."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key in value:
            value[key] = apply_defaults(value[key], schema["additionalProperties"])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def prune(value: Any, schema: dict[str, Any], root: bool = False) -> Any:
    """Drop fields the schema does not declare, unless x-kubernetes-preserve-unknown-fields."""
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return value
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        kept = {}
        for key, item in value.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                kept[key] = item
            elif props is not None and key in props:
                kept[key] = prune(item, props[key])
            elif isinstance(extra, dict):
                kept[key] = prune(item, extra)
            elif extra is True or (props is None and extra is None and schema.get("type") != "object"):
                kept[key] = item
        return kept
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"]) for item in value]
    return value


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _openapi_causes(obj: dict[str, Any], schema: dict[str, Any]) -> list[Cause]:
    validator = jsonschema.Draft4Validator(schema)
    causes = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        field = _path(error.absolute_path)
        if error.validator == "required":
            missing = error.message.split("'")[1]
            causes.append(Cause(f"{field}.{missing}" if field else missing, "Required value",
                                "FieldValueRequired"))
        elif error.validator == "enum":
            supported = ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in error.validator_value)
            causes.append(Cause(field, f"Unsupported value: {error.instance!r}: supported values: {supported}",
                                "FieldValueNotSupported"))
        elif error.validator == "type":
            causes.append(Cause(field, f'Invalid value: "{type(error.instance).__name__}": {field} in body '
                                       f"must be of type {error.validator_value}: {error.instance!r}",
                                "FieldValueTypeInvalid"))
        else:
            words = {"minimum": "should be greater than or equal to", "maximum": "should be less than or equal to",
                     "pattern": "should match", "maxLength": "may not be longer than",
                     "maxItems": "must have at most"}
            if error.validator in words:
                detail = f"{field} in body {words[error.validator]} {error.validator_value!r}"
            else:
                detail = error.message
            causes.append(Cause(field, f"Invalid value: {error.instance!r}: {detail}"))
    return causes


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """A JSON value as CEL sees it under its schema: `number` fields are doubles even when
    written as 2, as in the API server."""
    kind = schema.get("type")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return celtypes.MapType({celtypes.StringType(k): to_cel(v, props.get(k, extra)) for k, v in value.items()})
    if isinstance(value, list):
        return celtypes.ListType([to_cel(v, schema.get("items") or {}) for v in value])
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return celtypes.DoubleType(float(value))
    return celpy.json_to_cel(value)


class CELRules:
    """Compiles x-kubernetes-validations once and evaluates them over an object."""

    def __init__(self) -> None:
        self._env = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def _program(self, rule: str) -> Any:
        if rule not in self._programs:
            self._programs[rule] = self._env.program(self._env.compile(rule))
        return self._programs[rule]

    def causes(self, value: Any, schema: dict[str, Any], path: str) -> list[Cause]:
        found: list[Cause] = []
        for rule in schema.get("x-kubernetes-validations") or ():
            try:
                ok = self._program(rule["rule"]).evaluate({"self": to_cel(value, schema)})
                error = None if isinstance(ok, celtypes.BoolType) else f"rule evaluation error: {ok}"
            except celpy.CELEvalError as e:
                ok, error = False, f"rule evaluation error: {e.args[0]}"
            if error or not ok:
                field = (path + rule.get("fieldPath", "")).lstrip(".") or "<nil>"
                kind = schema.get("type", "object")
                message = error or rule.get("message") or f"failed rule: {rule['rule']}"
                found.append(Cause(field, f'Invalid value: "{kind}": {message}'))
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key in value:
                    found += self.causes(value[key], sub, f"{path}.{key}" if path else key)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                found += self.causes(item, schema["items"], f"{path}[{i}]")
        return found


class CRDVersionSchema:
    """The schema of one served version of a CRD, applied the way the API server applies it."""

    def __init__(self, schema: dict[str, Any]):
        self.schema = schema
        self._cel = CELRules()

    def admit(self, obj: dict[str, Any]) -> tuple[dict[str, Any], list[Cause]]:
        """(defaulted and pruned object, causes); the write is refused when causes is not empty."""
        obj = apply_defaults(copy.deepcopy(obj), self.schema)
        obj = prune(obj, self.schema, root=True)
        body = {k: v for k, v in obj.items() if k != "metadata"}
        causes = _openapi_causes(body, {**self.schema, "properties": {
            k: v for k, v in (self.schema.get("properties") or {}).items() if k != "metadata"}})
        if not causes:
            # Rules at the root see metadata.name and metadata.generateName, and nothing else
            # of metadata (Kubernetes docs, "Validation rules": "self.metadata.name").
            meta = obj.get("metadata") or {}
            causes = self._cel.causes({**body, "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta}},
                                      self.schema, "")
        return obj, causes
