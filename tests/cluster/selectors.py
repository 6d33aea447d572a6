"""Label and field selectors as the API server parses them (?labelSelector=, ?fieldSelector=)."""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Predicate = Callable[[Mapping[str, Any]], bool]

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


class SelectorError(ValueError):
    pass


def _split(selector: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b=c` -> [`a in (x,y)`, `b=c`]."""
    parts, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(selector: str | None) -> Callable[[Mapping[str, str]], bool]:
    """A predicate over a labels dict. Supports =, ==, !=, in, notin, key and !key."""
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _split(selector or ""):
        if m := _SET_RE.match(term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            checks.append((lambda k, vs: lambda l: l.get(k) in vs)(key, values) if op == "in"
                          else (lambda k, vs: lambda l: l.get(k) not in vs)(key, values))
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            checks.append((lambda k, v: lambda l: l.get(k) != v)(key, value))
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            checks.append((lambda k, v: lambda l: l.get(k) == v)(key, value))
        elif term.startswith("!"):
            checks.append((lambda k: lambda l: k not in l)(term[1:].strip()))
        elif re.fullmatch(r"[A-Za-z0-9./_-]+", term):
            checks.append((lambda k: lambda l: k in l)(term))
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return lambda labels: all(check(labels) for check in checks)


def _field(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def parse_field_selector(selector: str | None) -> Predicate:
    """A predicate over an object: `metadata.name=x`, `status.phase!=Running`, comma-joined."""
    checks: list[Predicate] = []
    for term in _split(selector or ""):
        if "!=" in term:
            path, value = term.split("!=", 1)
            checks.append((lambda p, v: lambda o: _field(o, p) != v)(path.strip(), value.strip()))
        elif "=" in term:
            path, value = term.replace("==", "=").split("=", 1)
            checks.append((lambda p, v: lambda o: _field(o, p) == v)(path.strip(), value.strip()))
        else:
            raise SelectorError(f"invalid field selector: {term!r}")
    return lambda obj: all(check(obj) for check in checks)


def selector_predicate(label_selector: str | None, field_selector: str | None) -> Predicate:
    labels = parse_label_selector(label_selector)
    fields = parse_field_selector(field_selector)
    return lambda obj: labels((obj.get("metadata") or {}).get("labels") or {}) and fields(obj)


def match_label_selector(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector object ({matchLabels, matchExpressions}) against a labels dict."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or ())
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True
