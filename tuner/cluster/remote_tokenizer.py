"""The tokenizer of the engine being tuned, over HTTP: vLLM's `POST /tokenize` and
`/detokenize`, which kvpilot's engine serves too. The in-cluster tuner builds its ShareGPT or
trace load with it, so the operator image needs neither transformers nor the model, and the
prompt lengths are the engine's own counts (for `runtime: vllm` as well).

Shapes (vLLM `TokenizeCompletionRequest` / `DetokenizeRequest`):
    POST /tokenize   {"model", "prompt", "add_special_tokens"} -> {"count", "max_model_len", "tokens"}
    POST /detokenize {"model", "tokens"} -> {"prompt"}
The API key (argument, else $VLLM_API_KEY) goes in the Authorization header only; it is never
part of a message, a repr or a log line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvpilot.engine.settings.env import VLLM_API_KEY

API_KEY_ENV = VLLM_API_KEY


class RemoteTokenizerError(httpx.HTTPError):
    """The engine refused or failed a tokenization request (status and its message); an
    httpx.HTTPError, so a trial that cannot build its load fails as one that cannot reach its
    engine (transient)."""


class RemoteTokenizer:
    """`encode`, `decode`, `__call__` (a batch, as Hugging Face tokenizers) and `vocab_size`,
    as `kvpilot.loadgen.datasets` and `kvpilot.tuner.measure.workload` use a tokenizer.

    base_url: the engine's root (e.g. http://name.ns.svc:8000; a trailing /v1 is dropped);
    model: the served model name; concurrency: requests in flight for a batch.
    Raises RemoteTokenizerError for an HTTP error answer, httpx.HTTPError when unreachable."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 60.0,
                 concurrency: int = 8) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self._concurrency = max(1, concurrency)
        self._vocab_size: int | None = None

    def __repr__(self) -> str:  # no headers: they hold the key
        return f"RemoteTokenizer({self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        """Closes the HTTP client (its pooled connections to the engine)."""
        self._client.close()

    def _post(self, path: str, body: dict) -> httpx.Response:
        return self._client.post(path, json={"model": self.model, **body})

    @staticmethod
    def _json(r: httpx.Response) -> dict:
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            raise RemoteTokenizerError(f"{r.request.method} {r.request.url.path}: HTTP {r.status_code}: {message}")
        return r.json()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special tokens as the engine's tokenizer adds them by default)."""
        return list(self._json(self._post("/tokenize", {"prompt": text,
                                                         "add_special_tokens": add_special_tokens}))["tokens"])

    def __call__(self, texts: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, list]:
        """{"input_ids": ids} for one text, or a list of ids per text, tokenized concurrently."""
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens)}
        with ThreadPoolExecutor(self._concurrency) as pool:
            ids = list(pool.map(lambda t: self.encode(t, add_special_tokens), texts))
        return {"input_ids": ids}

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token `ids`, from the engine's /detokenize. Raises RemoteTokenizerError on a
        non-200 answer (e.g. an id past the vocabulary)."""
        return str(self._json(self._post("/detokenize", {"tokens": [int(t) for t in ids]}))["prompt"])

    @property
    def vocab_size(self) -> int:
        """The smallest token id /detokenize refuses (kvpilot's engine answers 400 past the
        vocabulary), found by bisection in about 25 requests and then cached. Raises
        RemoteTokenizerError when the server accepts every id up to 2**31 (no range check)."""
        if self._vocab_size is None:
            def accepted(token: int) -> bool:
                r = self._post("/detokenize", {"tokens": [token]})
                if r.status_code not in (200, 400):
                    self._json(r)
                return r.status_code == 200

            low, high = 0, 1 << 16  # accepted(low); find a refused high
            if not accepted(low):
                self._json(self._post("/detokenize", {"tokens": [low]}))
            while accepted(high):
                low, high = high, high * 2
                if high > 1 << 31:
                    raise RemoteTokenizerError(f"{self.base_url}/detokenize checks no token range: vocab_size unknown")
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (mid, high) if accepted(mid) else (low, mid)
            self._vocab_size = high
        return self._vocab_size
