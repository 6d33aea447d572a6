"""Bounds on what one HTTP request may ask of the server: sizes of its fields, its place in
the waiting queue (--max-queue-len, exact under concurrency) and its lifetime
(--request-deadline-s).

Size limits follow OpenAI and vLLM where they state one (OpenAI: `top_logprobs` <= 20,
completions `logprobs` <= 5 (vLLM allows up to its `max_logprobs`, 20); vLLM: `n` >= 1, a
prompt batch is a list); where neither does, kvpilot's own documented limits below:
a request cannot name more stop strings, stop token ids or prompts than these, nor a stop
string longer than MAX_STOP_STRING_CHARS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvpilot.engine.entrypoints.errors import APIError, bad_request
from kvpilot.engine.entrypoints.openai.protocol import _SamplingRequest

MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 128
MAX_PROMPTS = 64
DEADLINE_STATUS = 408


def check_request_limits(req: _SamplingRequest) -> None:
    """400 when a list field is longer than its cap. (Number bounds are the request models'
    own, protocol.py; min_tokens <= max_tokens <= max_model_len - prompt is checked with
    the prompt's length.)"""
    prompt = getattr(req, "prompt", None)  # completions: a batch is a list of texts or of id lists
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", param="prompt")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise bad_request(f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters, got {longest}",
                          param="stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                          f"{len(req.stop_token_ids)}", param="stop_token_ids")


class Admission:
    """One admitted HTTP request's place in the queue. `reserved` counts its engine requests
    not yet handed to the engine: the server counts them as waiting from the moment it
    admits them, so concurrent admissions cannot pass --max-queue-len before the engine
    sees them. `started()` hands one over (same event-loop step as the engine counting it);
    `close()` gives back what was never started and ends the request's time in flight."""

    def __init__(self, state, count: int) -> None:
        self.state = state
        self.reserved = count
        self.closed = False
        self.timed_out = False
        self._timer: asyncio.TimerHandle | None = None

    def started(self) -> None:
        """One reserved engine request was handed to the engine: it stops counting as reserved."""
        if self.reserved > 0:
            self.reserved -= 1
            self.state.num_reserved -= 1

    def start_deadline(self, abort: Callable[[str], None]) -> None:
        """After --request-deadline-s, abort(reason) is called and `timed_out` set."""
        deadline_s = self.state.request_deadline_s
        if deadline_s is None:
            return

        def expire() -> None:
            self.timed_out = True
            abort(f"aborted after the server's request deadline of {deadline_s:g} s (--request-deadline-s)")

        self._timer = asyncio.get_running_loop().call_later(deadline_s, expire)

    def deadline_error(self) -> APIError:
        """The 408 APIError (code request_timeout) for a request --request-deadline-s aborted."""
        return APIError(DEADLINE_STATUS, f"the request did not finish within the server's deadline of "
                        f"{self.state.request_deadline_s:g} s and was aborted; ask for fewer tokens",
                        code="request_timeout")

    def close(self) -> None:
        """Gives back the reservations never started and ends the request's time in flight
        (num_in_flight); idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        self.state.num_reserved -= self.reserved
        self.reserved = 0
        self.state.num_in_flight -= 1
