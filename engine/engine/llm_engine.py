"""The engine: takes requests, runs scheduler steps on the model and returns outputs.
One `step()` = schedule, execute, commit, detokenize, emit. Source: vLLM `LLMEngine`.

Errors are kept to the request they belong to: what runs for one request (its setup, its
logits processors, detokenizing it, its stop strings, building its output) ends that
request with finish_reason "error" (its KV blocks freed, `RequestOutput.error` saying why)
and the step goes on. An error in what the batch shares (scheduling, the model, the KV
cache, the scheduler's commit) leaves that state unknown and propagates out of `step()`."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.core.block_manager import BlockManager
from kvpilot.engine.config import EngineConfig, SchedulerConfig
from kvpilot.engine.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.executor.multiproc import create_executor
from kvpilot.engine.worker.kv_sizing import size_kv_cache
from kvpilot.engine.model_loader import load_tokenizer
from kvpilot.engine.outputs import CompletionOutput, RequestError, RequestMetrics, RequestOutput
from kvpilot.engine.sample.prompt_logprobs import record_prompt_logprobs
from kvpilot.engine.sampling_params import SamplingParams, bad_words_token_ids
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.settings import LIVE_SETTINGS
from kvpilot.engine.core.sequence import Sequence, SequenceStatus
from kvpilot.engine.structured_output.backend_xgrammar import GrammarCompiler, compiled_grammar

logger = logging.getLogger("kvpilot.engine")


@dataclass
class StepStats:
    """What one step did, for metrics and stats logs."""

    num_prompt_tokens: int  # prefill tokens computed
    num_generation_tokens: int  # tokens sampled
    num_preemptions: int
    finished: list[Sequence]
    duration_s: float
    # (num_tokens, context_len, is_prefill) per scheduled request: the MFU estimate's input (metrics/perf.py)
    batch: tuple[tuple[int, int, bool], ...] = ()


class LLMEngine:
    """Owns the tokenizer, the model runner or executor, the sized KV cache, the block manager
    and the scheduler. Raises what loading or cache sizing raises (ValueError for a model or
    settings that do not fit), after stopping any worker processes it started."""

    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer_for(config)
        t0 = time.monotonic()
        # one rank: a ModelRunner; more: the multi-process executor with the same API
        self.runner = create_executor(config)
        try:
            # with --max-model-len auto the config comes back with the length the cache holds
            self.config, num_blocks, num_swap_blocks = size_kv_cache(config, self.runner)
            self.runner.initialize_kv_cache(num_blocks, num_swap_blocks)
        except BaseException:
            self.close()
            raise
        config = self.config
        self.block_manager = BlockManager(
            num_blocks, config.cache.block_size, num_swap_blocks, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self.detokenize_incrementally = False  # the server turns it on for streaming
        self.last_step: StepStats | None = None
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        logger.info("engine ready in %.1f s", time.monotonic() - t0)

    def close(self) -> None:
        """Stops the worker ranks' processes, if any (also run at exit)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def check_health(self) -> None:
        """Raises RuntimeError naming the rank when a rank of a multi-process engine is gone
        (vLLM's `EngineClient.check_health`); nothing to check with one rank."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The xgrammar compiler for this engine's tokenizer, built on first use (importing
        xgrammar takes seconds); thread-safe, so the server compiles on its own threads."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.config.model.vocab_size)
            return self._grammar_compiler

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Builds the engine from EngineArgs; raises ValueError for invalid values."""
        return cls(args.create_engine_config())

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_s: float | None = None,
    ) -> Sequence:
        """Validates and queues a request. Raises ValueError for an empty prompt, token ids
        (prompt or allowed_token_ids) outside the vocabulary, a prompt that leaves no room
        under max_model_len, or a structured-output spec that cannot be compiled, and
        RequestError when its own setup (detokenizer, seeded generator) fails; either way
        nothing of it is left in the engine."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            text = prompt
        else:
            token_ids, text = list(prompt), None
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.config.model.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.allowed_token_ids is not None and any(not 0 <= t < vocab for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids contains out-of-vocab token ids; they must be in [0, {vocab})")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias contains out-of-vocab token ids; they must be in [0, {vocab})")
        if params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words, vocab)
        grammar = (compiled_grammar(self.grammar_compiler, params.structured_outputs)
                   if params.structured_outputs is not None else None)
        max_len = self.config.scheduler.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens but max_model_len is {max_len}: it must be shorter "
                f"to leave room for at least one output token"
            )
        seq = Sequence(request_id, token_ids, params, self.config.model.eos_token_ids, arrival_s)
        try:
            detok = (IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                     if self.detokenize_incrementally or params.stop else None)
            self.runner.sampler.add_request(request_id, params, seq.output_token_ids, grammar, token_ids,
                                            tuple(self.config.model.eos_token_ids))
        except Exception as exc:
            self.runner.sampler.forget(request_id)
            raise RequestError(f"request {request_id} could not be set up: {type(exc).__name__}: {exc}") from exc
        self.scheduler.add_request(seq)
        self._prompts[request_id] = text
        if detok is not None:
            self._detok[request_id] = detok
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees its KV blocks now. Returns False if unknown."""
        seq = self.scheduler.abort_request(request_id)
        self._forget(request_id)
        return seq is not None

    def update_scheduler_config(self, **changes) -> SchedulerConfig:
        """Changes scheduler limits (max_num_seqs, max_num_batched_tokens,
        enable_chunked_prefill, preemption_mode) at run time; they take effect at the next
        step and no request is dropped. Raises ValueError (nothing changed) when the new
        values break a rule or name another setting."""
        allowed = set(LIVE_SETTINGS)
        unknown = set(changes) - allowed
        if unknown:
            raise ValueError(f"cannot change {sorted(unknown)} at run time; live settings: {sorted(allowed)}")
        new = dataclasses.replace(self.scheduler.config, **changes)
        self.scheduler.config = new
        self.config = dataclasses.replace(self.config, scheduler=new)
        return new

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return self.scheduler.has_unfinished_requests()

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step and returns an output for every request that got a
        token (and for every request that finished)."""
        t0 = time.monotonic()
        sched_out = self.scheduler.schedule()
        for seq, _ in sched_out.scheduled:
            if seq.times.first_scheduled_s is None:
                seq.times.first_scheduled_s = t0
        sampled = self.runner.execute(sched_out)
        record_prompt_logprobs(sched_out.scheduled, self.runner.take_prompt_logprobs())
        failed = self.runner.sampler.take_errors()  # logits processors that raised, by request
        prompt_tokens = sum(n for s, n in sched_out.scheduled if s.num_computed_tokens < s.num_prompt_tokens)
        batch = tuple((n, s.num_computed_tokens + n, n > 1 or s.num_computed_tokens < s.num_prompt_tokens)
                      for s, n in sched_out.scheduled)
        updated = self.scheduler.update_from_output(sched_out, sampled)
        now = time.monotonic()
        outputs = [self._process(seq, now, failed.get(seq.request_id)) for seq in updated]
        finished = [seq for seq in updated if seq.is_finished]
        self.last_step = StepStats(
            prompt_tokens, len(updated), len(sched_out.preempted), finished, now - t0, batch
        )
        return outputs

    def _process(self, seq: Sequence, now: float, error: BaseException | None) -> RequestOutput:
        """The output of one sequence that got a token; the request's own failure (`error`
        from its logits processors, or one raised here) ends it alone."""
        try:
            if error is not None:
                raise error
            if seq.times.first_token_s is None:
                seq.times.first_token_s = now
            seq.times.last_token_s = now
            return self._make_output(seq, self._detokenize(seq))
        except Exception as exc:
            logger.exception("request %s failed and was ended; the engine goes on", seq.request_id)
            self.scheduler.finish_request(seq, SequenceStatus.FINISHED_ERROR)  # frees its KV blocks
            seq.status = SequenceStatus.FINISHED_ERROR  # even if it had just finished otherwise
            seq.error = f"{type(exc).__name__}: {exc}"
            seq.times.last_token_s = now
            return self._make_output(seq, "")

    def _detokenize(self, seq: Sequence) -> str:
        detok = self._detok.get(seq.request_id)
        if detok is None:
            if seq.is_finished:
                seq.output_text = self.tokenizer.decode(
                    seq.output_token_ids, skip_special_tokens=seq.sampling_params.skip_special_tokens
                )
            return ""
        delta = detok.add(seq.output_token_ids[-1:])
        seq.output_text = detok.text
        stops = seq.sampling_params.stop
        if stops and delta and not seq.is_finished:
            window = seq.output_text[-(len(delta) + max(map(len, stops)) - 1):]
            offset = len(seq.output_text) - len(window)
            hits = [(window.find(s), s) for s in stops if s in window]
            if hits:
                at, stop = min(hits)
                cut = offset + at
                if seq.sampling_params.include_stop_str_in_output:
                    cut += len(stop)
                delta = delta[: max(0, len(delta) - (len(seq.output_text) - cut))]
                seq.output_text = seq.output_text[:cut]
                seq.stop_reason = stop
                self.scheduler.finish_request(seq, SequenceStatus.FINISHED_STOPPED)
        return delta

    def _make_output(self, seq: Sequence, new_text: str) -> RequestOutput:
        finished = seq.is_finished
        if finished:
            seq.times.finished_s = seq.times.last_token_s
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            logprobs=list(seq.logprobs) if seq.sampling_params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        t = seq.times
        out = RequestOutput(
            request_id=seq.request_id,
            prompt=self._prompts.get(seq.request_id),
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=RequestMetrics(t.arrival_s, t.first_scheduled_s, t.first_token_s, t.last_token_s,
                                   t.finished_s, seq.num_preemptions, seq.num_cached_tokens),
            new_text=new_text,
            new_token_ids=seq.output_token_ids[-1:],
            error=seq.error,
            prompt_logprobs=seq.prompt_logprobs,
        )
        if finished:
            self._forget(seq.request_id)
        return out

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self.runner.sampler.forget(request_id)


def load_tokenizer_for(config: EngineConfig):
    """The Hugging Face tokenizer of the config's model directory (model_path)."""
    return load_tokenizer(Path(config.model_path))

