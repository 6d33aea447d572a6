"""Fuzz-drawn cases for the differential test: a greedy body on either generation route,
streamed or not, with a sampling field set to a value drawn from that field's valid values,
its bounds and past them, huge numbers or wrong types (the families of the
liveness fuzz, kvpilot.bench.reliability.fuzz_cases). Drawn with random.Random(SEED), whose
choice() sequence is stable across Python versions, so the ids and bodies are reproducible."""

from __future__ import annotations

import random

from oracle_cases import CHAT, CMPL
from oracle_compare import Case

SEED = 48
COUNT = 64  # the first 40 are those of the first version: ids stay
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
MESSAGES = [[{"role": "user", "content": text}] for text in
            ("Name a fruit.", "\u202e\u2066abc", "e\u0301" * 10, "Hi\x00there")]
HUGE = [2**31, 2**63, -(2**63) - 1, 10**30]
WRONG = ["5", True, None, [1], {"a": 1}]
COMMON = {  # field -> (valid values, values at or past a bound)
    "temperature": ([0, 0.7, 2.0], [2.01, -0.5, 1e308]),
    "top_p": ([0.5, 1.0, 1e-9], [0.0, 1.01, -0.1]),
    "top_k": ([-1, 0, 1, 20], [-2, 2**31, 1.5]),
    "min_p": ([0.0, 0.1, 1.0], [1.5, -0.1]),
    "seed": ([0, 7, 2**63 - 1], [-1, 2**63, 1.5]),
    "max_tokens": ([1, 4, 8], [0, -1, "8"]),
    "n": ([1], [2, 0, 17]),
    "stop": ([".", [" "], ["a"] * 4, []], ["", 5]),
    "stop_token_ids": ([[], [198]], [[2**31], [-1]]),
    "presence_penalty": ([0], [0.5, -2, 2.0, 2.5]),
    "frequency_penalty": ([0], [-0.5, 2.5]),
    "repetition_penalty": ([1.0], [0.5, 0, 2.5]),
    "ignore_eos": ([True, False], ["yes"]),
    "min_tokens": ([0, 4], [-1, 9]),
    "skip_special_tokens": ([False, True], []),
    "user": (["u"], [5]),
}
ONLY = {
    CMPL: {"logprobs": ([0, 5, 20], [21, -2]), "echo": ([True, False], []), "suffix": ([], ["x"]),
           "best_of": ([1], [2]), "prompt_logprobs": ([], [0, 1])},
    CHAT: {"logprobs": ([True, False], []), "top_logprobs": ([0, 5, 20], [21]), "max_completion_tokens": ([4], [0]),
           "parallel_tool_calls": ([False], []), "reasoning_effort": ([], ["low"])},
}


def _draw(rng: random.Random, index: int) -> Case:
    """One field drawn from any family, and half the time a second one from the valid values
    (one field at most that may be refused: which of two refusals a server names first is
    its validation order, not a difference)."""
    path = rng.choice([CMPL, CHAT])
    stream = rng.choice([False, True])
    body: dict = {"max_tokens": 6, "temperature": 0, "stream": stream}
    body.update({"prompt": rng.choice(PROMPTS)} if path == CMPL else {"messages": rng.choice(MESSAGES)})
    fields = {**COMMON, **ONLY[path]}
    name = rng.choice(sorted(fields))
    valid, past = fields[name]
    family = rng.choice(["valid", "bound", "huge", "wrong"])
    pool = {"valid": valid, "bound": past, "huge": HUGE, "wrong": WRONG}[family] or HUGE
    chosen = {name: rng.choice(pool)}
    if rng.random() < 0.5:
        other = rng.choice([f for f in sorted(fields) if f != name and fields[f][0]])
        chosen[other] = rng.choice(fields[other][0])
    body.update(chosen)
    route = "cmpl" if path == CMPL else "chat"
    words = " ".join(f"{k}={v!r}"[:40] for k, v in chosen.items())
    return Case(f"fuzz/{index:02d} {route}{' stream' * stream} {words}", path, body)


def fuzz_cases(count: int = COUNT, seed: int = SEED) -> list[Case]:
    """`count` drawn cases, the same ones for the same seed."""
    rng = random.Random(seed)
    return [_draw(rng, i) for i in range(count)]
