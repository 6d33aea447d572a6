"""Helpers of the decode stack tests (test_cpu_decode_stack*.py): a fixture listing the row
counts of the steps the stack served, greedy generation with the stack on or off (the model's
kernel path with or without it, applied as the engine applies one), and a check that the stack
needs a given weight copy."""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.engine import SamplingParams
from kvpilot.engine.models import cpu_decode_stack
from kvpilot.engine.models.cpu_decode_stack import DecodeStack


@pytest.fixture
def served_rows(monkeypatch):
    """Row counts of the steps the stack served (module steps are not listed)."""
    rows: list[int] = []
    forward = DecodeStack.forward

    def spy(self, input_ids, *args):
        out = forward(self, input_ids, *args)
        if out is not None:
            rows.append(input_ids.shape[0])
        return out

    monkeypatch.setattr(DecodeStack, "forward", spy)
    return rows


def generate(llm, prompts, stack: bool, max_tokens=(12, 7, 3)):
    """Greedy tokens and top-3 logprobs per prompt, the stack on or off. Where the model's path
    already has the stack as asked, its stack stays as it is (a test may have changed it);
    otherwise the path with the stack switched is applied for the run and the model's own again
    after it (a stack built anew)."""
    model = llm.engine.runner.model
    path = model.kernel_path
    if path.decode_stack != stack:
        cpu_decode_stack.apply(model, dataclasses.replace(path, decode_stack=stack))
    try:
        params = [SamplingParams(temperature=0, max_tokens=max_tokens[i % len(max_tokens)], ignore_eos=True,
                                 logprobs=3) for i in range(len(prompts))]
        outs = llm.generate(prompts, params)
    finally:
        if path.decode_stack != stack:
            cpu_decode_stack.apply(model, path)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def assert_no_stack_without(model, module, attr: str) -> None:
    """With module.<attr> (a weight copy the stack reads) removed, DecodeStack.build gives None;
    restored, it gives a stack again."""
    weight = getattr(module, attr)
    setattr(module, attr, None)
    try:
        assert DecodeStack.build(model) is None
    finally:
        setattr(module, attr, weight)
    assert DecodeStack.build(model) is not None
