"""POST /tokenize and /detokenize: the served model's tokenizer over HTTP, so that a client
without the model (the in-cluster tuner building its load) counts and cuts prompts exactly as
the engine does. Shapes and defaults are vLLM's (`serving_tokenization.py`,
`OpenAIServingTokenization`); unlike vLLM, they sit behind the API key like /v1/*.
Errors: 400 for bad input (token ids outside the vocabulary, unsupported options), 404
`model_not_found` for another model's name, 503 while the model loads."""

from __future__ import annotations

from kvpilot.engine.entrypoints.errors import APIError, bad_request
from kvpilot.engine.entrypoints.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from kvpilot.engine.entrypoints.openai.serving import ServerState
from kvpilot.engine.entrypoints.openai.serving_chat import chat_prompt

TOKENIZE_PATHS = ("/tokenize", "/detokenize")


class OpenAIServingTokenization:
    """The POST /tokenize and /detokenize handlers (vLLM's OpenAIServingTokenization) over the
    served model's tokenizer; 404 for another model's name, 503 while the model loads."""
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _tokenizer(self, model: str | None):
        names = self.state.model_names()
        if model is not None and model not in names:
            raise APIError(404, f"The model `{model}` does not exist. Served models: {sorted(names)}",
                           param="model", code="model_not_found")
        self.state.ready_engine()  # 503 while loading: the tokenizer comes with the engine
        return self.state.tokenizer

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """Token ids of a text prompt, or of a conversation through the chat template."""
        tokenizer = self._tokenizer(req.model)
        if isinstance(req, TokenizeChatRequest):
            if req.continue_final_message:
                raise bad_request("continue_final_message is not supported", param="continue_final_message")
            ids = chat_prompt(self.state, req)
            if req.add_special_tokens:  # what encode(add_special_tokens=True) adds, e.g. a BOS
                ids = with_special_tokens(tokenizer, ids)
        else:
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.state.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids; 400 when one is outside [0, vocab_size)."""
        tokenizer = self._tokenizer(req.model)
        vocab = self.state.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))


def with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """ids wrapped in the special tokens `encode(text, add_special_tokens=True)` puts around a
    text. transformers 5's tokenizers backend has no `build_inputs_with_special_tokens` (an
    AttributeError, a 500, before): then the wrapping is read off the encoding of one letter."""
    build = getattr(tokenizer, "build_inputs_with_special_tokens", None)
    if build is not None:
        return list(build(ids))
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    start = next((i for i in range(len(full)) if full[i:i + len(plain)] == plain), len(full))
    return full[:start] + list(ids) + full[start + len(plain):]
