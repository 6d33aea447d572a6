"""Request fields that OpenAI's or vLLM's API has and kvpilot does not implement. A request
that gives one of them with the value that asks for nothing (vLLM's default, or null) is
served; with any other value it is a 400 naming the field and saying why, never a 200 that
silently ignored it. A field no API knows is a 400 too, in OpenAI's words
("Unrecognized request argument supplied: ..."), where vLLM would log it and go on.
Sources: OpenAI API reference (chat/create, completions/create); vLLM
`vllm/entrypoints/openai/protocol.py` (ChatCompletionRequest, CompletionRequest, ChatMessage)."""

from __future__ import annotations

import json
from typing import Any

_BEAM = "beam search is not implemented"
_GUIDED = "vLLM's older spelling; give structured_outputs ({\"json\" | \"regex\" | \"choice\" | \"grammar\": ...})"
_NO_MEDIA = "kvpilot serves text-only models"

# field -> (values that ask for nothing, why another value is refused)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), _BEAM),
    "length_penalty": ((1.0,), _BEAM),
    "spaces_between_special_tokens": ((True,), "special tokens are always decoded as the tokenizer joins them"),
    "logits_processors": ((None, []), "per-request logits processors are not loaded from requests (vLLM V1 "
                          "refuses them too)"),
    "return_tokens_as_token_ids": ((None, False), "tokens are always returned as text"),
    "cache_salt": ((None,), "the prefix cache is not salted"),
    "kv_transfer_params": ((None,), "disaggregated prefill is not implemented"),
    "vllm_xargs": ((None, {}), "no custom extensions are loaded"),
    "priority": ((0,), "the scheduler is first come, first served (no --scheduling-policy priority)"),
    "request_id": ((None,), "request ids are chosen by the server (the X-Request-Id response header)"),
    "documents": ((None,), "the chat template is not given documents"),
    "chat_template": ((None,), "the model's own chat template is used"),
    "chat_template_kwargs": ((None, {}), "the chat template takes no extra arguments"),
    "continue_final_message": ((False,), "the last message is never continued"),
    "add_special_tokens": ((False,), "the chat template adds the special tokens"),  # chat; completions implement it
    "echo": ((False, None), "chat completions do not echo (completions do)"),  # chat; completions implement it
    "mm_processor_kwargs": ((None,), _NO_MEDIA),
    "audio": ((None,), _NO_MEDIA),
    "modalities": ((None, ["text"]), _NO_MEDIA),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "reasoning_effort": ((None,), "the served model does not reason"),
    "include_reasoning": ((True,), "the served model does not reason"),
    "functions": ((None,), "OpenAI's deprecated form; give tools"),
    "function_call": ((None,), "OpenAI's deprecated form; give tool_choice"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "web_search_options": ((None,), "web search is not implemented"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "store": ((None, False), "completions are not stored"),
    "metadata": ((None,), "completions are not stored"),
    "verbosity": ((None,), "verbosity is not implemented"),
    "prompt_cache_key": ((None,), "the prefix cache is keyed by the prompt's tokens"),
    "safety_identifier": ((None,), "no safety system is attached"),
    "guided_json": ((None,), _GUIDED), "guided_regex": ((None,), _GUIDED), "guided_choice": ((None,), _GUIDED),
    "guided_grammar": ((None,), _GUIDED), "guided_decoding_backend": ((None,), _GUIDED),
    "guided_whitespace_pattern": ((None,), _GUIDED), "structural_tag": ((None,), "structural tags are not implemented"),
    # in messages (what an OpenAI client sends back from an earlier answer)
    "refusal": ((None,), "refusals are not produced"),
    "annotations": ((None, []), "annotations are not produced"),
    "reasoning_content": ((None,), "the served model does not reason"),
}


def _asks_for_nothing(value: Any, noop: tuple[Any, ...]) -> bool:
    """True when value is one of noop, by type as well as value (True is not 1)."""
    return any(value is None if v is None else (type(value) is type(v) or {type(value), type(v)} <= {int, float})
               and value == v for v in noop)


def drop_noop_fields(data: Any, declared: set[str]) -> Any:
    """data (a raw request or message dict) without the undeclared fields of UNSUPPORTED that
    ask for nothing; the rest stay, for the model's extra="forbid" to refuse."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items()
            if k in declared or k not in UNSUPPORTED or not _asks_for_nothing(v, UNSUPPORTED[k][0])}


def extra_field_message(field: str, value: Any) -> str:
    """Why an undeclared field is refused."""
    if field in UNSUPPORTED:
        noop, why = UNSUPPORTED[field]
        allowed = " or ".join(json.dumps(v) for v in noop)
        return f"{field} is not supported by this server ({why}); leave it out or send {allowed}"
    return f"Unrecognized request argument supplied: {field}"


def has_lone_surrogate(value: Any) -> bool:
    """Whether a string, or any key or value nested in dicts and lists, holds a lone UTF-16
    surrogate (JSON's "\\ud800" escape decodes to one), which UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    return False
