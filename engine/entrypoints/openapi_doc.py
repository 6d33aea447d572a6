"""Fixes to the OpenAPI document FastAPI generates for the server (/openapi.json)."""

from __future__ import annotations

from pydantic import BaseModel


def exact_integer_bounds(doc: dict, models: list[type[BaseModel]]) -> dict:
    """FastAPI's OpenAPI model types minimum/maximum as floats, which turns int64's maximum
    into 2**63 (9.223372036854776e+18); puts pydantic's exact properties of `models` back
    into the document's components (in place; returns doc)."""
    components = doc.get("components", {}).get("schemas", {})
    for model in models:
        if model.__name__ in components:
            exact = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components[model.__name__]["properties"] = exact["properties"]
    return doc
