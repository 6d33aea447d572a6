"""Request and response bodies of POST /tokenize and /detokenize."""

from __future__ import annotations

from pydantic import BaseModel, Field

from kvpilot.engine.entrypoints.openai.protocol import ChatMessage, TokenId, _Request


# -------------------------------------------------------------- tokenization
# POST /tokenize and /detokenize, with vLLM's shapes (vllm/entrypoints/openai/protocol.py:
# TokenizeCompletionRequest, TokenizeChatRequest, TokenizeResponse, DetokenizeRequest,
# DetokenizeResponse). Defaults are vLLM's: special tokens added to a text prompt, not to a chat
# (its template already has them).
class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a text prompt (vLLM's TokenizeCompletionRequest)."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """POST /tokenize with chat messages, through the chat template (vLLM's TokenizeChatRequest)."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    """The answer of POST /tokenize (vLLM's TokenizeResponse): the token ids, their count, the
    server's max_model_len, and each token's text when return_token_strs was asked."""
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """POST /detokenize: token ids to decode (vLLM's DetokenizeRequest)."""
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    """The answer of POST /detokenize: the decoded text (vLLM's DetokenizeResponse)."""
    prompt: str
