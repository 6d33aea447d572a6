"""A request's state as the scheduler and block manager see it (vLLM v1 `Request`,
nano-vllm `Sequence`): plain state, derived values as properties."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvpilot.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a request is: queued (WAITING), in the batch with KV blocks on the device
    (RUNNING), with its blocks in host swap (SWAPPED), or finished; a finished status's value is
    the OpenAI finish_reason ('stop', 'length', 'abort', 'error'). Source: vLLM `RequestStatus`."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request's own code failed (vLLM's FinishReason.ERROR)

    @property
    def finished(self) -> bool:
        """True for the FINISHED_* statuses (stopped, length, aborted, error)."""
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
            SequenceStatus.FINISHED_ERROR,
        )


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.monotonic() seconds) for the latency metrics."""

    arrival_s: float = field(default_factory=time.monotonic)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None


class Sequence:
    """One request. Invariant: `num_computed_tokens <= num_tokens`; each step the
    scheduler gives it tokens so that num_computed_tokens catches up with num_tokens.

    block_table: ids of the KV blocks holding its tokens, in order (owned by the block
        manager; listed here so the model runner can address them).
    num_cached_tokens: prompt tokens found in the prefix cache at admission.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_s: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.num_preemptions = 0
        self.logprobs: list[dict[int, float]] = []
        # prompt_logprobs asked: per prompt position, None until computed (position 0 stays None)
        self.prompt_logprobs: list | None = (None if sampling_params.prompt_logprobs is None
                                             else [None] * len(self.prompt_token_ids))
        self.output_text = ""
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it ended with FINISHED_ERROR
        self.times = RequestTimes()
        if arrival_s is not None:
            self.times.arrival_s = arrival_s

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the length num_computed_tokens catches up with."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not yet in the cache: num_tokens - num_computed_tokens (1 for
        a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than one token waits for the model (a prompt, or the tokens of
        a request being recomputed after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True when every prompt position must be computed (prompt_logprobs asked), so the
        prefix cache is not read for it (vLLM's `SamplingParams.skip_reading_prefix_cache`)."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        """True once the status is a FINISHED_* one."""
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason ('stop', 'length', 'abort', 'error'), or None while unfinished."""
        return self.status.value if self.status.finished else None

    def token_id(self, index: int) -> int:
        """The token at position `index` of prompt + output (0-based). Raises IndexError past num_tokens."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, spanning both lists where needed."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
