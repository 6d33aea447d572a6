"""Server-side printing (`Accept: ...;as=Table`) for kubectl get, from a CRD's
additionalPrinterColumns and their JSONPath expressions."""
from __future__ import annotations

import datetime
import re
from typing import Any

from .resources import ResourceType

TABLE_ACCEPT = "as=Table"

_TOKEN = re.compile(r'\.([A-Za-z0-9_-]+)|\[\?\(@\.([A-Za-z0-9_.-]+)\s*==\s*"([^"]*)"\)\]|\[(\d+)\]')


def jsonpath(obj: Any, expr: str) -> list[Any]:
    """Values of a simple JSONPath (.a.b, [0], [?(@.k=="v")]); empty when absent."""
    current = [obj]
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"unsupported JSONPath {expr!r} at {pos}")
        pos = m.end()
        found = []
        for value in current:
            if m.group(1) is not None and isinstance(value, dict) and m.group(1) in value:
                found.append(value[m.group(1)])
            elif m.group(2) is not None and isinstance(value, list):
                found += [v for v in value if isinstance(v, dict) and str(v.get(m.group(2))) == m.group(3)]
            elif m.group(4) is not None and isinstance(value, list) and int(m.group(4)) < len(value):
                found.append(value[int(m.group(4))])
        current = found
    return current


def age(timestamp: str) -> str:
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    seconds = int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def to_table(rtype: ResourceType, items: list[dict[str, Any]], rv: str) -> dict[str, Any]:
    columns = rtype.printer_columns or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    definitions = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
    definitions += [{"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                     "description": c.get("description", ""), "priority": c.get("priority", 0)} for c in columns]
    rows = []
    for item in items:
        cells: list[Any] = [item["metadata"]["name"]]
        for column in columns:
            values = jsonpath(item, column["jsonPath"])
            if not values:
                cells.append(None)
            elif column.get("type") == "date":
                cells.append(age(values[0]))
            else:
                cells.append(values[0] if len(values) == 1 else ",".join(map(str, values)))
        rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                "metadata": item["metadata"]}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": rv},
            "columnDefinitions": definitions, "rows": rows}
