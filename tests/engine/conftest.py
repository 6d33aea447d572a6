"""Shared fixtures for engine tests: the real SmolLM2 model (converted once into the
cache), its tokenizer, and real ShareGPT prompts in the chat template."""

from __future__ import annotations

import pytest

from kvpilot.engine.model_loader import load_tokenizer, resolve_model_path
from kvpilot.loadgen.datasets import sharegpt_pairs

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def model_path():
    return resolve_model_path(MODEL)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    """The first 8 ShareGPT prompts (turn 0) of 8 to 120 tokens, as chat-template token
    ids; they share the template's system-prompt prefix."""
    prompts = []
    for prompt, _ in sharegpt_pairs():
        n = len(tokenizer.encode(prompt, add_special_tokens=False))
        if 8 <= n <= 120:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        if len(prompts) == 8:
            return prompts
    raise AssertionError("ShareGPT has fewer than 8 short prompts")


@pytest.fixture(scope="session")
def small_llm(model_path):
    """A float32 engine with a small, fixed KV cache, shared by tests that only read it."""
    from kvpilot.engine import LLM

    return LLM(str(model_path), dtype="float32", max_model_len=1024, max_num_seqs=8,
               num_gpu_blocks_override=256, swap_space=0.05)
