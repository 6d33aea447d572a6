"""The `prompt_logprobs` value of completions' choices and of chat answers, vLLM's shape:
per prompt position None for the first, else {token id: {logprob, rank, decoded_token}}.
Source: vLLM `vllm/logprobs.py` (`Logprob`), `vllm/entrypoints/openai/completion/protocol.py`
(`CompletionResponseChoice.prompt_logprobs`), `chat_completion/protocol.py`
(`ChatCompletionResponse.prompt_logprobs`)."""

from __future__ import annotations

from pydantic import BaseModel


class PromptLogprob(BaseModel):
    """One token at one prompt position (vLLM's `Logprob`): natural log, rank (1 = the most
    likely), the token's text decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
