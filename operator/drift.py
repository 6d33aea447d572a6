"""Whether a child object drifted from what the operator wants, and the JSON merge patch that
brings it back: the compare every ensure step makes before it writes (no write when nothing
changed). Values the API server rewrites (resource.Quantity in canonical form) compare by
value; keys it adds (defaults, status) don't count; label selectors compare exactly.

Sources: RFC 7386 (JSON merge patch); Kubernetes resource.Quantity (canonical form);
kubectl apply's drift check, which likewise ignores fields the server defaulted.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.utils.quantity import parse_quantity

# Fields whose values are resource.Quantity: the API server stores them in canonical form
# (cpu "0.5" reads back as "500m", a GPU count 6 as "6"), so they compare by value.
QUANTITY_MAPS = ("requests", "limits")
QUANTITY_FIELDS = ("sizeLimit",)


def same_quantity(actual: Any, desired: Any) -> bool:
    """Whether two resource.Quantity values are equal ("0.5" == "500m", 6 == "6", "1Gi" == "1024Mi")."""
    try:
        return parse_quantity(actual) == parse_quantity(desired)
    except (ValueError, TypeError):
        return actual == desired


# Label selectors: a key more than desired selects other pods (a Service that selected every pod
# of a group must drop kvpilot.dev/role when nnodes goes back to 1), so these compare exactly.
EXACT_MAPS = ("selector", "matchLabels")


def covers(actual: Any, desired: Any, quantity: bool = False, exact: bool = False) -> bool:
    """Whether actual has every value of desired. Keys the API server added (defaults, status)
    don't count as drift; a changed or missing value does, and so does an extra key in a label
    selector (EXACT_MAPS). Lists must match item by item. Quantities (container
    requests/limits, emptyDir sizeLimit) compare by value, since the API server rewrites them
    in canonical form."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and (not exact or set(actual) == set(desired)) and all(
            k in actual and covers(actual[k], v, quantity or k in QUANTITY_MAPS or k in QUANTITY_FIELDS,
                                   k in EXACT_MAPS)
            for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(actual) == len(desired)
                and all(covers(a, d) for a, d in zip(actual, desired)))
    return same_quantity(actual, desired) if quantity else actual == desired


def merge_patch(actual: Any, desired: Any) -> Any:
    """desired as a JSON merge patch (RFC 7386) over actual: as desired, plus null for every key
    of a label selector (EXACT_MAPS) that actual has and desired lacks, which removes it."""
    if not isinstance(desired, Mapping):
        return desired
    base = actual if isinstance(actual, Mapping) else {}
    patch = {k: merge_patch(base.get(k), v) for k, v in desired.items()}
    for k, v in desired.items():
        if k in EXACT_MAPS and isinstance(v, Mapping) and isinstance(base.get(k), Mapping):
            patch[k] = {**{extra: None for extra in base[k] if extra not in v}, **patch[k]}
    return patch
