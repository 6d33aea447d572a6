"""Offline batch inference: `LLM(model=..., **engine_args).generate(prompts, params)`,
and `chat(messages)` through the model's chat template. Source: vLLM `vllm.LLM`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from tqdm import tqdm

from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.engine.llm_engine import LLMEngine
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """Raises ValueError (from the engine arguments) on invalid settings."""

    def __init__(self, model: str = EngineArgs.model, **engine_args) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The engine's Hugging Face tokenizer (vLLM's LLM.get_tokenizer)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt (text or token ids); returns outputs in prompt order.
        Bad prompts or parameters raise ValueError before any request is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the chat template (with the generation prompt) to each conversation."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        """Token ids of one conversation through the model's chat template, with the generation
        prompt appended (the assistant turn's opening)."""
        out = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
