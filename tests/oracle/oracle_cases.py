"""The cases of kvpilot's own request tests, as data (tests/server/test_server_request_fields.py,
test_server_errors.py, test_server_openai.py, test_server_tokenize.py; the structured-output
and tool cases are in oracle_cases_structured.py), rewritten for the differential test: greedy
(temperature 0) wherever the original allows it so that texts compare, small max_tokens, and
the context bounds of the oracle's max_model_len (2048) instead of the shared server's 1024.
Each id names its source: fields/, errors/, openai/, tokenize/; chat/ are message shapes
(system, developer and tool roles, text parts, continued assistant turns)."""

from __future__ import annotations

from oracle_compare import Case

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "My favourite colour is"]
HI = [{"role": "user", "content": "Hi"}]
FRUIT = [{"role": "user", "content": "Name a fruit."}]
COMPLETION = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
CHAT_BODY = {"messages": HI, "max_tokens": 4, "temperature": 0}
LONG_PROMPT = "hello" + " hello" * 2099  # 2100 tokens > max_model_len (2048)
NEAR_FULL = "hello" + " hello" * 2039  # 2040 tokens: 8 left for the output
ROUTES = {"cmpl": (CMPL, COMPLETION), "chat": (CHAT, CHAT_BODY)}

REFUSED_FIELDS = [  # test_server_request_fields: kvpilot answers 400 naming the field
    ("min_p", 2.0), ("min_p", -0.1), ("allowed_token_ids", []), ("allowed_token_ids", [10**12]),
    ("allowed_token_ids", [49152]), ("truncate_prompt_tokens", -5), ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", 5000), ("use_beam_search", True), ("priority", 3),
    ("guided_json", {"type": "object"}), ("logits_processors", ["x.y"]), ("frobnicate", 1),
]
NOOP = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "logits_processors": None,
        "include_stop_str_in_output": False, "spaces_between_special_tokens": True, "store": False}
PENALIZED = {  # test_penalties_logit_bias_and_bad_words_change_a_greedy_answer, at 12 tokens
    "plain": {}, "bad_words Paris": {"bad_words": ["Paris"]}, "logit_bias 1e6": {"logit_bias": {"34": 1e6}},
    "logit_bias 100": {"logit_bias": {"34": 100}}, "repetition_penalty 1.8": {"repetition_penalty": 1.8},
    "frequency_penalty 2": {"frequency_penalty": 2.0}, "presence_penalty 2": {"presence_penalty": 2.0},
    "stop include_stop_str_in_output": {"stop": ["."], "include_stop_str_in_output": True},
}
FULL_MESSAGES = [{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Hello", "refusal": None, "annotations": None, "audio": None,
                  "function_call": None, "tool_calls": None},
                 {"role": "user", "content": "Bye"}]


def _fields_cases() -> list[Case]:
    cases = [Case(f"fields/{name}={value!r}/{route}", path, {**base, name: value})
             for name, value in REFUSED_FIELDS for route, (path, base) in ROUTES.items()]
    return cases + [
        Case("fields/noop/cmpl", CMPL, {**COMPLETION, **NOOP}),
        Case("fields/noop/chat", CHAT, {**CHAT_BODY, **NOOP, "messages": FULL_MESSAGES}),
        Case("fields/unknown field in a message", CHAT, {**CHAT_BODY, "messages": [{**HI[0], "mood": 1}]}),
        Case("fields/allowed_token_ids greedy", CMPL, {**COMPLETION, "allowed_token_ids": [7042, 30, 198],
                                                       "max_tokens": 6}),
        Case("fields/min_p 1 at temperature 2", CMPL, {**COMPLETION, "temperature": 2.0, "seed": 9, "min_p": 1.0}),
        Case("fields/truncate_prompt_tokens 3 echo", CMPL, {**COMPLETION, "truncate_prompt_tokens": 3, "echo": True,
                                                             "max_tokens": 1}),
        Case("fields/seed -1 n 2", CMPL, {**COMPLETION, "temperature": 1.0, "seed": -1, "n": 2}),
        Case("fields/token prompt clamped", CMPL, {**COMPLETION, "prompt": [42] * 2040, "max_tokens": 50,
                                                   "ignore_eos": True}),
    ] + [Case(f"fields/12 tokens {name}", CMPL, {**COMPLETION, "max_tokens": 12, "ignore_eos": True, **fields})
         for name, fields in PENALIZED.items()]


ERRORS = {  # test_server_errors.CASES: name -> (path, body)
    "malformed JSON": (CMPL, b'{"prompt": "Hi", "max_tokens": '),
    "body is not an object": (CMPL, b'["Hi"]'),
    "max_tokens wrong type": (CMPL, {"prompt": "Hi", "max_tokens": "many"}),
    "prompt wrong type": (CMPL, {"prompt": 12}),
    "temperature wrong type": (CHAT, {"messages": HI, "temperature": "hot"}),
    "messages not a list": (CHAT, {"messages": "Hi"}),
    "missing prompt": (CMPL, {"max_tokens": 3}),
    "missing messages": (CHAT, {"max_tokens": 3}),
    "empty messages": (CHAT, {"messages": []}),
    "empty prompt": (CMPL, {"prompt": ""}),
    "max_tokens zero": (CMPL, {"prompt": "Hi", "max_tokens": 0}),
    "max_tokens negative": (CHAT, {"messages": HI, "max_tokens": -5}),
    "max_tokens past max_model_len": (CMPL, {"prompt": NEAR_FULL, "max_tokens": 16}),
    "prompt too long": (CMPL, {"prompt": LONG_PROMPT, "max_tokens": 1}),
    "chat prompt too long": (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}),
    "negative temperature": (CMPL, {"prompt": "Hi", "temperature": -1}),
    "top_p out of range": (CMPL, {"prompt": "Hi", "top_p": 1.5}),
    "token id outside the vocabulary": (CMPL, {"prompt": [1, 2, 10**7]}),
    "image content": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                         "image_url": {"url": "x"}}]}]}),
    "stream_options without stream": (CMPL, {"prompt": "Hi", "stream_options": {"include_usage": True}}),
    "unsupported penalty": (CMPL, {"prompt": "Hi", "presence_penalty": 0.5}),
    "streamed request that is invalid": (CMPL, {"prompt": "Hi", "max_tokens": 0, "stream": True}),
    "seed beyond int64": (CHAT, {"messages": HI, "seed": 2**70}),
    "seed below int64": (CMPL, {"prompt": "Hi", "seed": -(2**63) - 1}),
    "NaN temperature": (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}'),
    "Infinity top_p": (CMPL, b'{"prompt": "Hi", "top_p": Infinity}'),
    "huge stop token id": (CMPL, {"prompt": "Hi", "stop_token_ids": [2**64]}),
    "huge top_k": (CMPL, {"prompt": "Hi", "top_k": 2**63}),
    "huge n": (CMPL, {"prompt": "Hi", "n": 10**30}),
    "logit_bias out of range": (CMPL, {"prompt": "Hi", "logit_bias": {"5": -1e9}}),
    "lone surrogate in a prompt": (CMPL, b'{"prompt": "Hi \\ud800"}'),
    "lone surrogate in a model name": (CHAT, b'{"model": "\\udfff", "messages": [{"role": "user", "content": "Hi"}]}'),
    "unknown model": (CMPL, {"model": "gpt-9", "prompt": "Hi"}),
    "unknown route": ("/v1/embeddings", {"input": "Hi"}),
}


def _openai_cases() -> list[Case]:
    cases = [Case(f"openai/greedy {p!r}{' stream' * s}", CMPL, {"prompt": p, "max_tokens": 6, "temperature": 0,
                                                                 "stream": s})
             for p in PROMPTS for s in (False, True)]
    cases += [Case(f"openai/chat greedy{' stream' * s}", CHAT, {"messages": FRUIT, "max_tokens": 6, "temperature": 0,
                                                                 "stream": s}) for s in (False, True)]
    return cases + [
        Case("openai/stream include_usage", CMPL, {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0,
                                                   "stream": True, "stream_options": {"include_usage": True}}),
        Case("openai/chat max_completion_tokens stream", CHAT, {"messages": FRUIT, "max_completion_tokens": 6,
                                                                "temperature": 0, "stream": True}),
        Case("openai/stop", CMPL, {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stop": ["."]}),
        Case("openai/batched prompts n 2 greedy", CMPL, {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 3,
                                                         "temperature": 0}),
        Case("openai/batched prompts", CMPL, {"prompt": PROMPTS, "max_tokens": 3, "temperature": 0}),
        Case("openai/echo", CMPL, {"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0, "echo": True}),
        Case("openai/echo stream", CMPL, {"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0, "echo": True,
                                          "stream": True}),
        Case("openai/logprobs 2", CMPL, {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "logprobs": 2}),
        Case("openai/chat top_logprobs 3", CHAT, {"messages": FRUIT, "max_tokens": 2, "temperature": 0,
                                                  "logprobs": True, "top_logprobs": 3}),
        Case("openai/seeded sampling", CMPL, {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 1.0, "seed": 7}),
        Case("openai/token id prompt", CMPL, {"prompt": [504, 3575, 282], "max_tokens": 6, "temperature": 0}),
        Case("openai/models", "/v1/models", method="GET"),
        Case("openai/wrong method", "/v1/models", method="DELETE"),
    ]


SYSTEM = {"role": "system", "content": "Answer in one word."}
CHAT_SHAPES = {  # chat/: how messages become a prompt (the chat template), compared by usage and text
    "system message": {"messages": [SYSTEM, *FRUIT]},
    "text parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a"},
                                                             {"type": "text", "text": "fruit."}]}]},
    "assistant turn": {"messages": FULL_MESSAGES},
    "named user": {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]},
    "developer role": {"messages": [{"role": "developer", "content": "Be brief."}, *FRUIT]},
    "tool result": {"messages": [*FRUIT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "apple"}]},
    "empty content": {"messages": [{"role": "user", "content": ""}]},
    "no generation prompt": {"messages": FRUIT, "add_generation_prompt": False},
    "continue final message": {"messages": [*FRUIT, {"role": "assistant", "content": "Apple is"}],
                               "continue_final_message": True, "add_generation_prompt": False},
    "echo": {"messages": [*FRUIT, {"role": "assistant", "content": "Apple is"}], "echo": True,
             "continue_final_message": True, "add_generation_prompt": False},
    "chat_template_kwargs": {"messages": FRUIT, "chat_template_kwargs": {"enable_thinking": False}},
    "unknown role": {"messages": [{"role": "wizard", "content": "Hi"}]},
    "stream include_usage": {"messages": FRUIT, "stream": True, "stream_options": {"include_usage": True}},
}
TOKENIZE = [  # test_server_tokenize.py
    ("prompt", "/tokenize", {"prompt": PROMPTS[0], "add_special_tokens": False}),
    ("prompt with token strs", "/tokenize", {"prompt": PROMPTS[0], "return_token_strs": True}),
    ("chat", "/tokenize", {"messages": FRUIT}),
    ("chat without generation prompt", "/tokenize", {"messages": FRUIT, "add_generation_prompt": False}),
    ("chat with special tokens", "/tokenize", {"messages": HI, "add_special_tokens": True}),
    ("detokenize", "/detokenize", {"tokens": [504, 3575, 282]}),
    ("unknown model", "/tokenize", {"model": "gpt-4", "prompt": "hi"}),
    ("detokenize unknown model", "/detokenize", {"model": "gpt-4", "tokens": [1]}),
    ("nothing to tokenize", "/tokenize", {"model": "smollm2-135m-instruct"}),
    ("prompt wrong type", "/tokenize", {"prompt": 5}),
    ("detokenize huge id", "/detokenize", {"tokens": [1, 10**9]}),
    ("detokenize negative id", "/detokenize", {"tokens": [-1]}),
    ("detokenize a string", "/detokenize", {"tokens": "1 2"}),
]


def request_test_cases() -> list[Case]:
    """Every case of this module."""
    errors = [Case(f"errors/{name}", path, body) for name, (path, body) in ERRORS.items()]
    tokenize = [Case(f"tokenize/{name}", path, body) for name, path, body in TOKENIZE]
    chat = [Case(f"chat/{name}", CHAT, {"max_tokens": 6, "temperature": 0, **body}) for name, body in CHAT_SHAPES.items()]
    return _fields_cases() + errors + _openai_cases() + tokenize + chat
