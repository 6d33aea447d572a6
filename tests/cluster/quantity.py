"""resource.Quantity as the API server stores it: parsed, then re-emitted in canonical form.

Source: the Kubernetes API reference, "Quantity" (k8s.io/apimachinery/pkg/api/resource):
"Before serializing, Quantity will be put in 'canonical form'. This means that Exponent/suffix
will be adjusted up or down (with a corresponding increase or decrease in Mantissa) such that:
no precision is lost, no fractional digits will be emitted, the exponent (or suffix) is as
large as possible. [...] 1.5 will be serialized as "1500m"; 1.5Gi will be serialized as
"1536Mi"." The suffix family (binary Ki..Ei, decimal n..E, or an e-exponent) is kept, except
that a binary value below 1024 or with a fraction is written in decimal; values are rounded up
to 1n ("numbers smaller than 1n are rounded up"). A JSON number is accepted as a quantity.
"""
from __future__ import annotations

import decimal
import re
from decimal import Decimal
from typing import Any

PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_BINARY = {"": 0, "Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_NUMBER = re.compile(r"^([+-]?)([0-9]+\.?[0-9]*|\.[0-9]+)(.*)$")
_NANO = Decimal("1e-9")


class QuantityError(ValueError):
    pass


def parse(text: Any) -> tuple[Decimal, str]:
    """(value, format) with format 'binary', 'decimal' or 'exponent'. Raises QuantityError."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise QuantityError(f"quantities must match the regular expression '{PATTERN}'")
    if isinstance(text, (int, float)):
        return Decimal(str(text)), "decimal"
    m = _NUMBER.match(text)
    if not m or text.strip() != text:
        raise QuantityError(f"quantities must match the regular expression '{PATTERN}'")
    sign, digits, suffix = m.groups()
    value = Decimal(sign + digits)
    if suffix in _BINARY and suffix:
        return value * Decimal(1024) ** _BINARY[suffix], "binary"
    if suffix in _DECIMAL:
        return value.scaleb(_DECIMAL[suffix]), "decimal"
    if re.fullmatch(r"[eE][-+]?[0-9]+", suffix):
        return value.scaleb(int(suffix[1:])), "exponent"
    raise QuantityError("unable to parse quantity's suffix")


def canonical(text: Any) -> str:
    """The string the API server stores for a quantity ("0.5" -> "500m", 6 -> "6")."""
    value, form = parse(text)
    value = value.quantize(_NANO, rounding=decimal.ROUND_CEILING) if value.as_tuple().exponent < -9 else value
    if value == 0:
        return "0"
    if form == "binary" and abs(value) >= 1024 and value == value.to_integral_value():
        power = max(k for k in range(7) if value % (Decimal(1024) ** k) == 0)
        suffix = next(s for s, k in _BINARY.items() if k == power)
        return f"{int(value / Decimal(1024) ** power)}{suffix}"
    exponent = max(e for e in range(-9, 19, 3) if value.scaleb(-e) == value.scaleb(-e).to_integral_value())
    mantissa = int(value.scaleb(-exponent))
    if form == "exponent":
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    return f"{mantissa}{next(s for s, e in _DECIMAL.items() if e == exponent)}"


def _pod_spec_quantities(pod_spec: dict[str, Any], prefix: str) -> list[tuple[dict[str, Any], str, str]]:
    """(holder, key, field path) of every quantity in a pod spec."""
    found = []
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(pod_spec.get(kind) or ()):
            for which in ("requests", "limits"):
                values = (container.get("resources") or {}).get(which) or {}
                found += [(values, k, f"{prefix}.{kind}[{i}].resources.{which}[{k}]") for k in values]
    for i, volume in enumerate(pod_spec.get("volumes") or ()):
        empty = volume.get("emptyDir")
        if isinstance(empty, dict) and "sizeLimit" in empty:
            found.append((empty, "sizeLimit", f"{prefix}.volumes[{i}].emptyDir.sizeLimit"))
    return found


def canonicalize(kind: str, obj: dict[str, Any]) -> list[tuple[str, str]]:
    """Rewrite the quantities of a Pod or a pod template (Deployment, ReplicaSet) in place, in
    canonical form; returns (field, message) for each one that does not parse."""
    if kind == "Pod":
        pod_spec, prefix = obj.get("spec") or {}, "spec"
    elif kind in ("Deployment", "ReplicaSet"):
        pod_spec, prefix = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}, "spec.template.spec"
    else:
        return []
    errors = []
    for holder, key, path in _pod_spec_quantities(pod_spec, prefix):
        try:
            holder[key] = canonical(holder[key])
        except QuantityError as e:
            errors.append((path, f'Invalid value: "{holder[key]}": {e}'))
    return errors
