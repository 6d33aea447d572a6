"""The three PATCH content types: JSON merge patch (RFC 7386), JSON patch (RFC 6902), and
strategic merge patch for the built-in types (lists of named things merge by their key)."""
from __future__ import annotations

import copy
from typing import Any

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"

# Merge keys of the lists that strategic merge patch merges instead of replacing.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name",
              "conditions": "type", "ownerReferences": "uid"}


class PatchError(ValueError):
    pass


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(patch, list) and key in MERGE_KEYS and isinstance(target, list):
        merge_key = MERGE_KEYS[key]
        result = [copy.deepcopy(t) for t in target]
        for item in patch:
            if not isinstance(item, dict) or merge_key not in item:
                return copy.deepcopy(patch)
            index = next((i for i, t in enumerate(result)
                          if isinstance(t, dict) and t.get(merge_key) == item[merge_key]), None)
            if item.get("$patch") == "delete":
                if index is not None:
                    result.pop(index)
            elif index is None:
                result.append(copy.deepcopy(item))
            else:
                result[index] = strategic_merge_patch(result[index], item)
        return result
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, value in patch.items():
        if k.startswith("$"):
            continue
        if value is None:
            result.pop(k, None)
        else:
            result[k] = strategic_merge_patch(result.get(k), value, k)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(target: Any, ops: list[dict[str, Any]]) -> Any:
    doc = copy.deepcopy(target)
    for op in ops:
        parts = _pointer(op["path"])
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1] if parts else None
        kind = op["op"]
        try:
            if kind == "test":
                current = parent[int(last)] if isinstance(parent, list) else parent[last]
                if current != op["value"]:
                    raise PatchError(f"test failed at {op['path']}")
            elif kind in ("add", "replace"):
                if isinstance(parent, list):
                    index = len(parent) if last == "-" else int(last)
                    if kind == "add":
                        parent.insert(index, copy.deepcopy(op["value"]))
                    else:
                        parent[index] = copy.deepcopy(op["value"])
                else:
                    if kind == "replace" and last not in parent:
                        raise PatchError(f"replace: missing {op['path']}")
                    parent[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            else:
                raise PatchError(f"unsupported op {kind!r}")
        except (KeyError, IndexError, TypeError) as e:
            raise PatchError(f"{kind} {op['path']}: {e}") from e
    return doc


def apply_patch(content_type: str, target: dict[str, Any], patch: Any) -> dict[str, Any]:
    kind = content_type.split(";")[0].strip()
    if kind == MERGE:
        return merge_patch(target, patch)
    if kind == STRATEGIC:
        return strategic_merge_patch(target, patch)
    if kind == JSON_PATCH:
        return json_patch(target, patch)
    raise PatchError(f"unsupported patch content type {content_type!r}")
