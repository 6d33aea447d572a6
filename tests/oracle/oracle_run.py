"""Running every case against both servers: a few cases at a time, each sent to vLLM and to
kvpilot at once; the texts of greedy answers are tokenized by each server afterwards."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from oracle_compare import Case, Outcome, differing_aspect, send, tokenize

PARALLEL_CASES = 8  # cases in flight at once (each on both servers)
DETAILED = ("usage", "text", "finish_reason", "tokens", "logprobs", "prompt_logprobs")  # aspects whose values a row shows


@dataclass
class Result:
    """One case's answers (theirs is None for a case not sent to vLLM) and the first aspect in
    which they differ (None: equal, or not compared)."""
    case: Case
    theirs: Outcome | None
    ours: Outcome
    aspect: str | None
    seconds: float = 0.0


def run_case(vllm_url: str, our_url: str, case: Case) -> Result:
    """Sends the case to both servers (at once) and compares the answers."""
    start = time.monotonic()
    result = _run_case(vllm_url, our_url, case)
    result.seconds = time.monotonic() - start
    return result


def _run_case(vllm_url: str, our_url: str, case: Case) -> Result:
    if not case.vllm:
        return Result(case, None, send(our_url, case), None)
    with ThreadPoolExecutor(2) as pool:
        theirs_future = pool.submit(send, vllm_url, case)
        ours = send(our_url, case)
        theirs = theirs_future.result()
    if case.greedy and theirs.texts and theirs.texts == ours.texts:
        theirs.tokens, ours.tokens = tokenize(vllm_url, theirs.texts), tokenize(our_url, ours.texts)
    return Result(case, theirs, ours, differing_aspect(case, theirs, ours))


def run_all(vllm_url: str, our_url: str, cases: list[Case]) -> list[Result]:
    """Every case's Result, in the order of `cases`."""
    with ThreadPoolExecutor(PARALLEL_CASES) as pool:
        return list(pool.map(lambda c: run_case(vllm_url, our_url, c), cases))


def describe(outcome: Outcome | None, aspect: str | None) -> str:
    """The outcome as the table's cell writes it: its signature in backticks, and for a
    difference in DETAILED aspects, those values (cut at 120 characters)."""
    if outcome is None:
        return "`not sent`"
    if aspect in DETAILED:
        detail = {"text": outcome.texts, "finish_reason": outcome.finish, "tokens": outcome.tokens,
                  "logprobs": outcome.logprobs, "usage": outcome.usage,
                  "prompt_logprobs": outcome.prompt_logprobs}[aspect]
        return f"`{outcome.signature}` {aspect}={detail!r}"[:120].replace("|", "\\x7c")
    return f"`{outcome.signature}`"
