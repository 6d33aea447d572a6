"""Sending one case to a server and comparing two answers (the differential test, issue 48).

An answer is reduced to an Outcome: the status class (2xx, 4xx, 5xx; a stream that carries an
error event is "2xx+error"), the error's `param` for a 4xx (vLLM names pydantic's failures by
their location, "body.max_tokens": the "body." is dropped; where vLLM's param is null, kvpilot
naming the field is not counted as a difference, OpenAI's param being optional), the prompt's
token count of a 2xx, and for greedy requests (temperature 0) that succeed: the text of every
choice (a chat choice's content followed by its tool calls, name and arguments), its
finish_reason, the token ids of that text, the logprobs and prompt_logprobs when asked for
(within LOGPROB_TOLERANCE) and the completion's token count. A stream's text is its deltas
concatenated, its finish_reason the last one sent.

Token ids: neither /v1 route returns the generated ids on both servers (kvpilot refuses
`return_tokens_as_token_ids`, vLLM's `return_token_ids` is not served by kvpilot), so the
ids are each server's own POST /tokenize of the generated text (no special tokens): equal
texts tokenized by each server's tokenizer. Where logprobs are asked for, the sampled tokens
themselves are compared too."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

TIMEOUT_S = 120.0
ASPECTS = ("status", "param", "usage", "text", "finish_reason", "tokens", "logprobs", "prompt_logprobs")  # first differing
LOGPROB_TOLERANCE = 0.01  # float32 on both; the kernels differ


@dataclass(frozen=True)
class Case:
    """One request. body: a JSON value, or bytes sent as they are; vllm: False for a case that
    is not sent to vLLM (it harms vLLM's server; the table says what vLLM does)."""
    id: str
    path: str
    body: object = None
    method: str = "POST"
    vllm: bool = True

    @property
    def greedy(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("temperature") == 0 and \
            not isinstance(self.body.get("temperature"), bool)

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True


@dataclass
class Outcome:
    """What a server answered, reduced to what the test compares."""
    status: int
    param: str | None = None
    stream_error: bool = False
    texts: list[str] = field(default_factory=list)
    finish: list[object] = field(default_factory=list)
    tokens: list[list[int]] | None = None
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens) of a whole answer
    logprobs: list[list[tuple[str, float]]] | None = None  # per choice, (token, logprob) of each sampled token
    prompt_logprobs: list | None = None  # per choice: None or {token id: {logprob, rank, decoded_token}} per position
    raw: str = ""  # the start of the body, for the report

    @property
    def signature(self) -> str:
        """'2xx', '2xx+error', '4xx param=NAME', '5xx'; 'no answer' (timeout, connection lost)."""
        if self.status == 0:
            return "no answer"
        cls = f"{self.status // 100}xx"
        if self.stream_error:
            return f"{cls}+error"
        return f"{cls} param={self.param}" if self.status // 100 == 4 else cls


def _param(body: object) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    return param.removeprefix("body.") if isinstance(param, str) else param


def _choice_text(choice: dict) -> str:
    message = choice.get("message")
    if message is None:
        return choice.get("text") or ""
    calls = "".join(f"<call {c['function']['name']} {c['function']['arguments']}>"
                    for c in message.get("tool_calls") or [])
    return (message.get("content") or "") + calls


def _choice_logprobs(choice: dict) -> list[tuple[str, float]]:
    logprobs = choice.get("logprobs") or {}
    if logprobs.get("content") is not None:  # chat
        return [(t["token"], t["logprob"]) for t in logprobs["content"]]
    return list(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))


def _collect_stream(lines) -> tuple[dict[int, str], dict[int, object], bool]:
    texts: dict[int, str] = {}
    finish: dict[int, object] = {}
    calls: dict[tuple[int, int], list[str]] = {}
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            return texts, finish, True
        for choice in chunk.get("choices") or []:
            i = choice["index"]
            delta = choice.get("delta") or {}
            texts[i] = texts.get(i, "") + (choice.get("text") or delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault((i, call.get("index", 0)), ["", ""])
                entry[0] += (call.get("function") or {}).get("name") or ""
                entry[1] += (call.get("function") or {}).get("arguments") or ""
            if choice.get("finish_reason") is not None:
                finish[i] = choice["finish_reason"]
    for (i, _), (name, arguments) in sorted(calls.items()):
        texts[i] = texts.get(i, "") + f"<call {name} {arguments}>"
    return texts, finish, False


def send(url: str, case: Case) -> Outcome:
    """Sends `case` to the server at `url`; the Outcome of its answer."""
    kwargs: dict = {"timeout": TIMEOUT_S}
    if isinstance(case.body, bytes):
        kwargs.update(content=case.body, headers={"Content-Type": "application/json"})
    elif case.body is not None:
        kwargs.update(content=json.dumps(case.body).encode("utf-8", "surrogatepass"),
                      headers={"Content-Type": "application/json"})
    try:
        with httpx.Client() as client, client.stream(case.method, url + case.path, **kwargs) as r:
            if r.status_code == 200 and case.stream:
                texts, finish, error = _collect_stream(r.iter_lines())
                order = sorted(set(texts) | set(finish))
                return Outcome(200, stream_error=error, texts=[texts.get(i, "") for i in order],
                               finish=[finish.get(i) for i in order], raw="(stream)")
            raw = r.read().decode(errors="replace")
    except httpx.HTTPError as e:  # a timeout, or a server gone
        return Outcome(0, raw=f"{type(e).__name__}: {e}")
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    outcome = Outcome(r.status_code, param=_param(body), raw=raw[:300])
    if r.status_code == 200 and isinstance(body, dict) and isinstance(body.get("choices"), list):
        choices = sorted(body["choices"], key=lambda c: c.get("index", 0))
        outcome.texts = [_choice_text(c) for c in choices]
        outcome.finish = [c.get("finish_reason") for c in choices]
        if any(c.get("logprobs") for c in choices):
            outcome.logprobs = [_choice_logprobs(c) for c in choices]
        prompt = [c.get("prompt_logprobs") for c in choices] if "message" not in choices[0] else \
            [body.get("prompt_logprobs")]
        outcome.prompt_logprobs = prompt if any(p is not None for p in prompt) else None
        usage = body.get("usage") or {}
        if isinstance(usage.get("prompt_tokens"), int):
            outcome.usage = (usage["prompt_tokens"], usage.get("completion_tokens"))
    return outcome


def tokenize(url: str, texts: list[str]) -> list[list[int]]:
    """The server's own token ids of each text, without special tokens."""
    return [httpx.post(f"{url}/tokenize", json={"prompt": t, "add_special_tokens": False}, timeout=TIMEOUT_S
                       ).json().get("tokens", []) if t else [] for t in texts]


def _logprobs_differ(theirs: list | None, ours: list | None) -> bool:
    if theirs is None or ours is None:
        return theirs is not ours
    pairs = [(a, b) for x, y in zip(theirs, ours) for a, b in zip(x, y)]
    return [len(x) for x in theirs] != [len(y) for y in ours] or any(
        a[0] != b[0] or _far(a[1], b[1]) for a, b in pairs)


def _far(a: float | None, b: float | None) -> bool:
    """Two logprobs differ: one is None (an echoed first token has none) and the other not, or
    they are more than LOGPROB_TOLERANCE apart."""
    if a is None or b is None:
        return a is not b
    return abs(a - b) > LOGPROB_TOLERANCE


def _prompt_logprobs_differ(theirs: list | None, ours: list | None) -> bool:
    """Positions, token ids, ranks and decoded tokens equal; logprobs within LOGPROB_TOLERANCE."""
    if theirs is None or ours is None:
        return theirs is not ours
    flat = [(a, b) for x, y in zip(theirs, ours) for a, b in zip(x or [], y or [])]
    if [len(x or []) for x in theirs] != [len(y or []) for y in ours] or any((a is None) != (b is None) for a, b in flat):
        return True
    for a, b in ((a, b) for a, b in flat if a is not None):
        if set(a) != set(b) or any(a[k]["rank"] != b[k]["rank"] or a[k].get("decoded_token") != b[k].get("decoded_token")
                                   or _far(a[k]["logprob"], b[k]["logprob"]) for k in a):
            return True
    return False


def differing_aspect(case: Case, theirs: Outcome, ours: Outcome) -> str | None:
    """The first of ASPECTS in which the two outcomes differ, or None. Of a 2xx on both: the
    prompt's token count (usage); and of greedy cases only, the texts, finish_reasons, token
    ids, the sampled tokens' logprobs and the prompt_logprobs where asked (tokens equal,
    values within LOGPROB_TOLERANCE), then the completion's token count."""
    if theirs.status // 100 != ours.status // 100 or theirs.stream_error != ours.stream_error:
        return "status"
    if theirs.status // 100 == 4 and theirs.param is not None and theirs.param != ours.param:
        return "param"
    if theirs.status // 100 != 2 or theirs.stream_error:
        return None
    both = theirs.usage is not None and ours.usage is not None
    if both and theirs.usage[0] != ours.usage[0]:
        return "usage"
    if not case.greedy:
        return None
    if theirs.texts != ours.texts:
        return "text"
    if theirs.finish != ours.finish:
        return "finish_reason"
    if theirs.tokens is not None and ours.tokens is not None and theirs.tokens != ours.tokens:
        return "tokens"
    if _logprobs_differ(theirs.logprobs, ours.logprobs):
        return "logprobs"
    if _prompt_logprobs_differ(theirs.prompt_logprobs, ours.prompt_logprobs):
        return "prompt_logprobs"
    return "usage" if both and theirs.usage != ours.usage else None
