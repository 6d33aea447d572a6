"""Cases that break one constraint of a CRD's OpenAPI schema each, derived from the schema
itself, so that a test can send every one to the API server: for each property with a
minimum, maximum, exclusiveMinimum, enum, pattern, maxLength, maxItems or required list, a
value just outside it (and, for bounds, the bound itself, which must pass)."""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

# What the API server's message says for each kind of violation (k8s.io/apiextensions-apiserver
# pkg/apiserver/validation via kube-openapi's validate, and field.Error's type strings).
MESSAGES = {"minimum": "greater than or equal to", "maximum": "less than or equal to",
            "exclusiveMinimum": "greater than", "enum": "Unsupported value", "pattern": "should match",
            "maxLength": "Too long", "maxItems": "Too many", "required": "Required value"}


@dataclass(frozen=True)
class Case:
    path: tuple[str, ...]  # where the value goes under the object, e.g. ("spec", "engine", "seed")
    constraint: str        # the schema keyword broken ("" for a bound that must pass)
    value: Any             # the value set there (absent for "required": the key is removed)

    @property
    def field(self) -> str:
        """The field path as the API server names it: spec.engine.env[0].name."""
        return ".".join(self.path).replace(".[]", "[0]")

    def apply(self, obj: dict[str, Any], parents: dict[str, Any]) -> dict[str, Any]:
        """A copy of obj with this case's value set. `parents` gives minimal valid objects for
        the objects and list items on the way, by dotted path: {"spec.engine.env.[]": {"name": "A"}}."""
        obj = copy.deepcopy(obj)
        node, keys, i = obj, self.path, 0
        while i < len(keys) - 1:
            key, prefix = keys[i], ".".join(keys[:i + 1])
            if keys[i + 1] == "[]":
                if not isinstance(node.get(key), list) or not node[key]:
                    node[key] = [copy.deepcopy(parents.get(prefix + ".[]", {}))]
                node, i = node[key][0], i + 2
                continue
            if not isinstance(node.get(key), dict):
                node[key] = copy.deepcopy(parents.get(prefix, {}))
            node, i = node[key], i + 1
        if self.constraint == "required":
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = self.value
        return obj


def _matching(pattern: str | None, length: int) -> str:
    """A string of `length` characters that matches `pattern`."""
    for start in ("a", "/a", "builtin://a", "1", "1.0", "A"):
        for pad in ("a", "0"):
            text = (start + pad * length)[:length] if len(start) <= length else start
            if pattern is None or re.fullmatch(pattern.strip("^$"), text):
                return text
    raise ValueError(f"no candidate string of {length} characters matches {pattern}")


def _breaks(schema: dict[str, Any], path: tuple[str, ...]) -> list[Case]:
    cases = []
    kind = schema.get("type")
    step = 1 if kind == "integer" else 0.5
    if "minimum" in schema:
        low = schema["minimum"]
        if schema.get("exclusiveMinimum"):
            cases.append(Case(path, "exclusiveMinimum", low))
        else:
            cases += [Case(path, "minimum", low - step), Case(path, "", low)]
    if "maximum" in schema:
        cases += [Case(path, "maximum", schema["maximum"] + step), Case(path, "", schema["maximum"])]
    if "enum" in schema:
        cases.append(Case(path, "enum", 3 if kind == "integer" else "not-a-choice"))
    if "pattern" in schema:
        cases.append(Case(path, "pattern", "!bad"))
    if "maxLength" in schema:
        cases.append(Case(path, "maxLength", _matching(schema.get("pattern"), schema["maxLength"] + 1)))
    if "maxItems" in schema:
        item = schema["items"]
        one = {k: _matching(item["properties"][k].get("pattern"), 1) for k in item.get("required", [])} \
            if item.get("type") == "object" else "--x"
        cases.append(Case(path, "maxItems", [copy.deepcopy(one) for _ in range(schema["maxItems"] + 1)]))
    for name in schema.get("required", []):
        cases.append(Case(path + (name,), "required", None))
    return cases


def schema_cases(schema: dict[str, Any], path: tuple[str, ...] = ()) -> list[Case]:
    """Every case of the schema under `path` (status and metadata excluded by the caller)."""
    cases = _breaks(schema, path) if path else []
    for name, child in (schema.get("properties") or {}).items():
        cases += schema_cases(child, path + (name,))
    if "items" in schema and schema["items"].get("type") == "object":
        cases += schema_cases(schema["items"], path + ("[]",))
    return cases
