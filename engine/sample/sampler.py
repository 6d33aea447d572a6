"""Token sampling for a batch of requests with per-request parameters.

Before sampling, a row's constraints narrow it: its logits processors, its allowed_token_ids
and its grammar's token bitmask (batched over the step's structured rows, structured_output/bitmask.py);
then bad_words, min_tokens, logit_bias and the penalties change its logits (batched over the
step's rows that use them, logits_adjust.py), for greedy rows too, as vLLM v1's.
Greedy rows take the argmax. Random rows apply temperature, top-k and top-p, then draw by
the exponential race (argmax of p / q with q ~ Exp(1)), which lets a seeded request draw
its noise from its own generator while the batch shares one kernel; where the CPU kernel path
has it (c_sample), rows with a temperature only are drawn in C instead, by inverse transform
sampling from one uniform per row keyed from the same generators (kernels/cpu/sample.py). Logprobs
come from the model's raw distribution (log_softmax of the unprocessed logits), as vLLM returns by
default. Source: vLLM v1 `Sampler` / `TopKTopPSampler`.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.kernels.cpu import sample as cpu_sample
from kvpilot.kernels.cpu.loader import KernelsNotBuilt

from kvpilot.engine.structured_output.bitmask import GrammarBitmasks
from kvpilot.engine.sample.logits_adjust import LogitsAdjustments
from kvpilot.engine.sampling_params import SamplingParams


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] -> [rows] int64, the first index of each row's maximum (NaN counts as the
    maximum), as torch.argmax(dim=-1). On CPU through numpy's SIMD argmax: 16 x 49,152 float32
    rows took 0.09 ms against torch's 0.9 ms on a 2-core AVX2 EPYC."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return x.argmax(dim=-1)
    return torch.from_numpy(np.argmax(x.detach().contiguous().numpy(), axis=-1).astype(np.int64))


class Sampler:
    """Per-request state (a seeded request's generator, its logits processors' view of its
    output) is set up by `add_request`, so that a request whose setup fails is refused on
    its own; a logits processor that raises is recorded in `errors` (request id -> the
    exception) for the engine to end that request, and the batch is sampled as usual."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self._output_token_ids: dict[str, list[int]] = {}
        self._allowed_token_ids: dict[str, torch.Tensor] = {}
        self.grammars: GrammarBitmasks | None = None  # built with the first grammar
        self.adjust = LogitsAdjustments()
        self.errors: dict[str, BaseException] = {}
        # random rows with a temperature only: drawn in C (kernels/cpu/sample.py) where the engine's CPU
        # kernel path has it (engine/cpu/kernel_path.py), else the torch ops of __call__
        self.fused_sampling = _path_samples_in_c()

    def add_request(self, request_id: str, params: SamplingParams, output_token_ids: list[int],
                    grammar: object | None = None, prompt_token_ids: list[int] | None = None,
                    eos_token_ids: tuple[int, ...] = ()) -> None:
        """Builds the request's generator (seeded requests); `output_token_ids` is the live
        list its logits processors, penalties and bad words see; `grammar` is its compiled
        xgrammar grammar, if any; `prompt_token_ids` feed the repetition penalty and
        `eos_token_ids` the min_tokens ban. Raises what torch raises for a seed it cannot take."""
        if params.seed is not None:
            self._request_generators[request_id] = torch.Generator().manual_seed(params.seed)
        if params.logits_processors:
            self._output_token_ids[request_id] = output_token_ids
        if params.allowed_token_ids is not None:
            self._allowed_token_ids[request_id] = torch.tensor(sorted(set(params.allowed_token_ids)))
        self.adjust.add(request_id, params, prompt_token_ids or [], output_token_ids, eos_token_ids)
        if grammar is not None:
            if self.grammars is None:
                info = grammar.tokenizer_info
                self.grammars = GrammarBitmasks(info.vocab_size, list(info.stop_token_ids))
            self.grammars.add(request_id, grammar)

    def forget(self, request_id: str) -> None:
        """Drops everything kept for a finished or aborted request: its generator, logits-processor
        view, allowed ids, adjustments, grammar matcher and pending error."""
        self._request_generators.pop(request_id, None)
        self._output_token_ids.pop(request_id, None)
        self._allowed_token_ids.pop(request_id, None)
        self.adjust.forget(request_id)
        if self.grammars is not None:
            self.grammars.forget(request_id)
        self.errors.pop(request_id, None)

    def take_errors(self) -> dict[str, BaseException]:
        """The requests whose logits processors raised since the last call."""
        errors, self.errors = self.errors, {}
        return errors

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        gen = self._request_generators.get(request_id)
        if gen is None:  # a request that did not pass add_request (the engine's warm-up)
            gen = self._request_generators[request_id] = torch.Generator().manual_seed(params.seed)
        return gen

    def _apply_logits_processors(self, logits: torch.Tensor, request_ids: list[str],
                                 params: list[SamplingParams]) -> None:
        """Runs each row's processors on that row in place; a processor that raises (or
        returns a row of another shape) leaves the row as it was and records the error."""
        for row, (request_id, p) in enumerate(zip(request_ids, params)):
            if not p.logits_processors or request_id in self.errors:
                continue
            output = self._output_token_ids.get(request_id, [])
            try:
                values = logits[row].clone()
                for processor in p.logits_processors:
                    values = processor(list(output), values)
                if not isinstance(values, torch.Tensor) or values.shape != logits[row].shape:
                    raise TypeError(f"a logits processor returned {type(values).__name__}, not a "
                                    f"[{logits.shape[-1]}] tensor")
                logits[row] = values
            except Exception as exc:  # noqa: BLE001 - the request's own code: it ends that request only
                self.errors[request_id] = exc

    def _constrained(self, request_ids: list[str], params: list[SamplingParams]) -> bool:
        grammars = self.grammars
        return (any(p.logits_processors for p in params) or any(r in self._allowed_token_ids for r in request_ids)
                or (grammars is not None and any(r in grammars for r in request_ids))
                or self.adjust.active(request_ids))

    def _narrowed(self, request_ids: list[str]) -> set[str]:
        """The rows a grammar or allowed_token_ids narrowed (a ban could leave them no token)."""
        grammars = self.grammars
        return {r for r in request_ids if r in self._allowed_token_ids or (grammars is not None and r in grammars)}

    def _apply_allowed_token_ids(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """-inf for every token outside a row's allowed_token_ids (vLLM's mask), in place."""
        for row, request_id in enumerate(request_ids):
            allowed = self._allowed_token_ids.get(request_id)
            if allowed is not None:
                kept = logits[row, allowed].clone()
                logits[row] = float("-inf")
                logits[row, allowed] = kept

    def _exponential_noise(self, probs: torch.Tensor, rows: list[tuple[str, SamplingParams]]) -> torch.Tensor:
        """Exp(1) noise shaped like probs [rows, vocab] float32: -log(U), U ~ Uniform[0, 1)
        (inverse CDF; U = 0 gives +inf, so that token is not drawn), one uniform draw for all
        unseeded rows from the shared generator, a row from its own generator for a seeded
        request. torch's CPU `exponential_` took 18 ms for 16 x 49,152 draws on a 2-core AVX2
        EPYC, uniform_ and log 4 ms."""
        noise = torch.empty_like(probs)
        seeded = [params.seed is not None for _, params in rows]
        if not any(seeded):
            noise.uniform_(generator=self.generator)
        else:
            for row, (request_id, params) in enumerate(rows):
                noise[row].uniform_(generator=self._generator(request_id, params))
        return noise.log_().neg_()

    def _c_sampled_rows(self, logits: torch.Tensor, rows: list[int], request_ids: list[str],
                        params: list[SamplingParams]) -> torch.Tensor:
        """The tokens of `rows` (random rows with a temperature only) drawn straight from their logits
        in C (kernels/cpu/sample.py, inverse transform sampling): each row's key is one 63-bit draw
        from its generator (a seeded
        request's own, else the shared one: one draw for all of those), so a seed fixes its tokens as
        before. A row with no finite logit gets its greedy token (its argmax), as the torch path would."""
        keys = torch.empty(len(rows), dtype=torch.int64)
        shared = [j for j, i in enumerate(rows) if params[i].seed is None]
        if shared:
            keys[shared] = torch.randint(0, 2**63 - 1, (len(shared),), generator=self.generator, dtype=torch.int64)
        for j, i in enumerate(rows):
            if params[i].seed is not None:
                keys[j] = torch.randint(0, 2**63 - 1, (1,), generator=self._generator(request_ids[i], params[i]),
                                        dtype=torch.int64)[0]
        inv_t = torch.tensor([1.0 / params[i].temperature for i in rows], dtype=torch.float32)
        sub = logits if len(rows) == logits.shape[0] else logits[rows]
        drawn = cpu_sample.sample_from_logits(sub, inv_t, keys)
        empty = (drawn < 0).nonzero().flatten().tolist()
        if empty:
            drawn[empty] = argmax_rows(sub[empty])
        return drawn

    def _tokens(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        """[rows] int64: each row's token from its (adjusted) logits [rows, vocab] float32: the argmax of a
        greedy row; a random row with a temperature only drawn in C where the kernel path has it, any
        other random row by the exponential race over its top-k / top-p / min-p probabilities."""
        n = logits.shape[0]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        plain = []
        if random_rows and self.fused_sampling and logits.device.type == "cpu":
            plain = [i for i in random_rows if _temperature_only(params[i], logits.shape[-1])]
        if plain:
            # the rows drawn in C need no argmax (a full pass over [rows, vocab]: ~1.3 ms of a 64-row step)
            in_c = set(plain)
            others = [i for i in range(n) if i not in in_c]
            tokens = torch.empty(n, dtype=torch.int64)
            if others:
                tokens[others] = argmax_rows(logits[others])
            tokens[plain] = self._c_sampled_rows(logits, plain, request_ids, params)
            random_rows = [i for i in random_rows if i not in in_c]
        else:
            tokens = argmax_rows(logits)
        if random_rows:
            idx = torch.tensor(random_rows)
            sub = logits[idx] / torch.tensor([params[i].temperature for i in random_rows]).unsqueeze(1)
            sub = _apply_top_k_top_p(
                sub,
                [params[i].top_k for i in random_rows],
                [params[i].top_p for i in random_rows],
            )
            probs = _apply_min_p(sub.softmax(dim=-1), [params[i].min_p for i in random_rows])
            tokens[idx] = argmax_rows(probs / self._exponential_noise(probs, [(request_ids[i], params[i])
                                                                            for i in random_rows]))
        return tokens

    def __call__(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[tuple[int, dict[int, float] | None]]:
        """logits: [num_seqs, vocab_size] float32, one row per request; rows a constraint changes
        are changed in place unless a row asks for logprobs (which come from the raw rows).
        Returns, per row, the token id and (when `params.logprobs` is set) a dict of
        logprobs: the chosen token's and the top-N tokens'."""
        logits = logits.float().contiguous()
        raw = logits  # logprobs come from the raw rows, as vLLM's do by default
        if self._constrained(request_ids, params):
            if any(p.logprobs is not None for p in params):  # else the caller's rows are free to change
                logits = logits.clone()
            self._apply_logits_processors(logits, request_ids, params)
            self._apply_allowed_token_ids(logits, request_ids)
            if self.grammars is not None:
                self.grammars.mask(logits, request_ids)
            self.adjust.apply(logits, request_ids, self._narrowed(request_ids))
        n = logits.shape[0]
        tokens = self._tokens(logits, request_ids, params)
        token_list = tokens.tolist()
        self.adjust.accept(request_ids, token_list)
        if self.grammars is not None:
            self.errors.update(self.grammars.accept(request_ids, token_list))
        want = [p.logprobs for p in params]
        if all(w is None for w in want):
            return [(t, None) for t in token_list]
        logprobs = raw.log_softmax(dim=-1)
        vocab = logprobs.shape[-1]
        want = [vocab if w == -1 else w for w in want]  # -1: every token's, as vLLM's
        top_n = min(vocab, max(w or 0 for w in want))
        top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
        results = []
        for i in range(n):
            if want[i] is None:
                results.append((token_list[i], None))
                continue
            entry = {token_list[i]: logprobs[i, token_list[i]].item()}
            if want[i]:
                for tid, val in zip(top_ids[i, : want[i]].tolist(), top_vals[i, : want[i]].tolist()):
                    entry.setdefault(tid, val)
            results.append((token_list[i], entry))
        return results


def _path_samples_in_c() -> bool:
    """Whether the process's CPU kernel path draws random rows in C (False where no kernels were built)."""
    try:
        return cpu_kernel_path.current().c_sample
    except KernelsNotBuilt:
        return False


def _temperature_only(p: SamplingParams, vocab: int) -> bool:
    """Whether a random row's draw needs no top-k, top-p or min-p (the fused kernel's rows)."""
    return (p.top_k == -1 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0


def _apply_min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Zeroes (in place) each row's tokens whose probability is below min_p x the row's
    highest; probs [rows, vocab] float32. Source: vLLM v1 `Sampler.apply_min_p`."""
    if all(p <= 0.0 for p in min_p):
        return probs
    floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p).unsqueeze(1)
    return probs.masked_fill_(probs < floor, 0.0)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k and nucleus top-p; always keeps the
    most likely token. logits: [rows, vocab] float32."""
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k]).clamp(max=vocab)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop |= before >= torch.tensor(top_p).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)
