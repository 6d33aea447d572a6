"""The cluster admin's policy for the InferenceService fields that choose what runs where:
which images, which node selectors and which GPU resource names a resource may ask for.
In cluster-wide mode anyone who may create an InferenceService would otherwise run any
image, on any node, through the operator. Set by chart values (`policy.*`), passed as
environment variables; an empty list allows anything. A refusal is an InvalidSpec with a
CamelCase reason, shown as the Failed condition.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpilot.api.spec import InferenceServiceSpec

from kvpilot.operator.validation import InvalidSpec
from kvpilot.engine.settings.env import (
    KVPILOT_ALLOWED_GPU_RESOURCES, KVPILOT_ALLOWED_IMAGE_PREFIXES, KVPILOT_ALLOWED_NODE_SELECTORS,
)


def _split(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


@dataclass(frozen=True)
class Policy:
    """allowed_image_prefixes: spec.engine.image must start with one ("" allows any).
    allowed_node_selectors: "key=value" or "key=*" entries that each spec.resources.nodeSelector
    pair must match. allowed_gpu_resources: names spec.resources.gpuResourceName may take."""

    allowed_image_prefixes: tuple[str, ...] = ()
    allowed_node_selectors: tuple[str, ...] = ()
    allowed_gpu_resources: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Policy":
        """KVPILOT_ALLOWED_IMAGE_PREFIXES, KVPILOT_ALLOWED_NODE_SELECTORS and
        KVPILOT_ALLOWED_GPU_RESOURCES, each a comma-separated list."""
        return cls(_split(env.get(KVPILOT_ALLOWED_IMAGE_PREFIXES, "")),
                   _split(env.get(KVPILOT_ALLOWED_NODE_SELECTORS, "")),
                   _split(env.get(KVPILOT_ALLOWED_GPU_RESOURCES, "")))

    def check(self, spec: InferenceServiceSpec) -> None:
        """Raise InvalidSpec (ImageNotAllowed, NodeSelectorNotAllowed, GPUResourceNotAllowed)."""
        image = spec.engine.image
        if image and self.allowed_image_prefixes and not image.startswith(self.allowed_image_prefixes):
            raise InvalidSpec("ImageNotAllowed", (
                f"spec.engine.image {image!r} is not allowed here; images must start with one of "
                f"{list(self.allowed_image_prefixes)} (the operator's policy.allowedImagePrefixes)"))
        if self.allowed_node_selectors:
            for key, value in spec.resources.nodeSelector:
                if f"{key}={value}" not in self.allowed_node_selectors and f"{key}=*" not in self.allowed_node_selectors:
                    raise InvalidSpec("NodeSelectorNotAllowed", (
                        f"spec.resources.nodeSelector {key}={value} is not allowed here; allowed: "
                        f"{list(self.allowed_node_selectors)} (the operator's policy.allowedNodeSelectors)"))
        gpu = spec.resources.gpuResourceName
        if spec.resources.gpu and self.allowed_gpu_resources and gpu not in self.allowed_gpu_resources:
            raise InvalidSpec("GPUResourceNotAllowed", (
                f"spec.resources.gpuResourceName {gpu!r} is not allowed here; allowed: "
                f"{list(self.allowed_gpu_resources)} (the operator's policy.allowedGPUResources)"))
