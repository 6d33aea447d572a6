"""`make demo`'s tuning part: vLLM's performance-tuning guide, told on whatever CPU runs it.

The guide's story (docs.vllm.ai, "Optimization and Tuning", "Preemption"): when the KV
cache cannot hold every running request, the scheduler preempts one ("Sequence group ... is
preempted by PreemptionMode.RECOMPUTE mode because there is not enough KV cache space ...
total_cumulative_preemption_cnt=N"), `vllm:num_preemptions_total` rises and latency
suffers; the remedies are more KV cache (raise gpu_memory_utilization or the parallel sizes)
or fewer requests at once (lower max_num_seqs or max_num_batched_tokens).

The demo builds that situation from this machine's own measurements, so that it holds on
every CPU kind (a fast AMX CPU and a slow AVX2 one differ by 10x in speed, not in tokens):
1. `calibrate`: the engine with its defaults serves a few demo requests one at a time:
   the unloaded TTFT and TPOT on this machine. Replies are capped at the length one
   request serves in about REQUEST_TARGET_S seconds alone (32 to 64 tokens), which gives the
   request latency L; a slow or busy CPU gets shorter replies rather than a longer demo.
2. The KV cache, in bytes (`--kv-cache-memory-bytes`, vLLM's KV budget): the window's
   ShareGPT requests are sampled first, and the cache is sized to hold CACHE_REQUESTS of the
   longest (prompt + output tokens, in whole blocks) at the KV bytes per token of the dtype
   the engine picks on this CPU (bfloat16 with native bf16, float32 otherwise), and at least
   one max_model_len request. The load is a burst of BURST requests arriving together (vLLM
   bench serve's `--request-rate inf`): the defaults (256 sequences) admit all of them, their
   decodes outgrow the cache, and the newest are preempted, on any CPU, because that is
   counted in tokens, not seconds.
3. SLOs from the calibration: no preemptions (the guide's symptom); p95 TTFT = TTFT + R x
   L with R = ceil(BURST / CACHE_REQUESTS) + 1 rounds (a request may wait for the burst
   ahead of it to pass through a cache that holds CACHE_REQUESTS at once); p95 ITL = TTFT
   + 2 x TPOT (a token may wait for one other request's prefill step and its own decode).
4. `kvpilot tune --local` searches the guide's two remedies: more KV cache
   (`--kv-cache-memory-bytes` up to KV_CACHE_GROWTH times the demo's, a restart per change)
   and fewer requests at once (max_num_seqs and max_num_batched_tokens, changed live), and
   prints each trial; `story.before_after` then prints the defaults against the winner in the
   guide's terms and writes before_after.png.
With `--runtime vllm` (`python -m kvpilot.tuner.demo --runtime vllm`) the same story runs on
upstream vLLM (`kvpilot.tuner.local.vllm_runtime`): calibration and trials start `vllm serve` (with
--enforce-eager: about 30 s a start on 2 cores instead of 80-100 s compiled; a restart per trial,
vLLM has no live changes), the cache is counted in its CPU block size (32), and the evidence
of preemption is `vllm:num_preemptions_total`; its log shows only the symptom, stats lines
each second (VLLM_LOG_STATS_INTERVAL=1) with the KV cache 100% used and requests sent back to
waiting (vLLM 0.32 logs no line per preemption: `vllm_runtime`'s doc).
On a machine that is not idle the story holds because the engine slows in proportion to the
CPU it gets (engine/cpu/thread_adapter.py, engine/cpu/omp_wait.py): the calibration and the trials
run the same engine process beside the same neighbours, so the SLOs it sets are what the
trials can meet.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.settings import BY_NAME, RUNTIMES
from kvpilot.tuner import cli

MODEL, MAX_MODEL_LEN = "smollm2-135m-instruct", 256
# Replies of at least MIN_OUTPUT tokens grow each admitted request by 2+ KV blocks while it
# decodes: the growth that outruns the cache once prompts have filled it (shorter replies fit
# in what admission leaves free, and nothing is preempted).
MAX_PROMPT, MAX_OUTPUT, MIN_OUTPUT = 64, 64, 32
BURST, CACHE_REQUESTS = 8, 3  # requests per window, arriving together; longest ones the KV cache holds
WARMUP_REQUESTS = 1
REQUEST_TARGET_S = 3.0  # replies are capped so that one request alone takes about this long here
KV_CACHE_GROWTH = 4  # the search's largest KV cache, in multiples of the demo's (still a few MB here)
VLLM_ARGS = ["--enforce-eager"]  # every vLLM start of the demo: see the module doc
CALIBRATION_KV_BYTES = 64 << 20  # vLLM on CPU needs its cache in bytes; ample for one request at a time
# what the engine log shows of preemptions, and what the demo calls those lines
PREEMPTION_LOG = {"kvpilot": (" is preempted by ", "preemption warning(s)"),
                  "vllm": ("KV cache usage: 100.0%", "stats line(s) with the KV cache full (vLLM 0.32 logs no "
                                                     "preemption line)")}
SEARCH = [BY_NAME["max_num_batched_tokens"].flag, "128:2048", BY_NAME["max_num_seqs"].flag, "2:256",
          "--chunked-prefill", "on"]


@dataclass(frozen=True)
class Calibration:
    """Medians of requests served one at a time by the default engine (seconds)."""

    ttft_s: float
    tpot_s: float

    @property
    def max_output_len(self) -> int:
        """Output tokens per request: as many as fit REQUEST_TARGET_S on this machine, in
        [MIN_OUTPUT, MAX_OUTPUT] (a slow or busy CPU gets shorter replies, not a longer demo)."""
        fit = int((REQUEST_TARGET_S - self.ttft_s) / max(self.tpot_s, 1e-3))
        return max(MIN_OUTPUT, min(MAX_OUTPUT, fit))

    @property
    def latency_s(self) -> float:
        """One request of max_output_len tokens alone."""
        return self.ttft_s + (self.max_output_len - 1) * self.tpot_s

    def slo_args(self) -> list[str]:
        """The demo's SLO flags (see the module doc)."""
        rounds = math.ceil(BURST / CACHE_REQUESTS) + 1
        return ["--slo-ttft-ms", f"{(self.ttft_s + rounds * self.latency_s) * 1000:.0f}",
                "--slo-itl-ms", f"{(self.ttft_s + 2 * self.tpot_s) * 1000:.0f}",
                "--max-preemptions-per-min", "0"]


@dataclass(frozen=True)
class Cache:
    """The demo's KV cache: `num_blocks` blocks of `block_size` tokens at `token_bytes` bytes
    per token (K and V over every layer, in the engine's dtype on this CPU)."""

    num_blocks: int
    block_size: int
    token_bytes: int
    dtype: str

    @property
    def kv_cache_memory_bytes(self) -> int:
        """The cache's size in bytes, as the engine's --kv-cache-memory-bytes takes it."""
        return self.num_blocks * self.block_size * self.token_bytes


def workload_args(max_output_len: int, burst: int = BURST) -> list[str]:
    """One burst of `burst` ShareGPT requests per window (the tuner's default seed samples them)."""
    return ["--num-requests", str(burst), "--request-rate", "inf", "--warmup-requests", str(WARMUP_REQUESTS),
            "--max-prompt-len", str(MAX_PROMPT), "--max-output-len", str(max_output_len)]


def size_cache(longest_request_tokens: int, block_size: int | None = None) -> Cache:
    """The KV cache that holds CACHE_REQUESTS of the window's longest request at once (and at
    least one max_model_len one), priced with this machine's engine dtype
    (`kvpilot.tuner.search.feasibility.Hardware`), in blocks of `block_size` tokens (default: the
    engine default's)."""
    from kvpilot.engine.config import ParallelConfig
    from kvpilot.engine.distributed.parallel_layout import rank_kv_bytes_per_token
    from kvpilot.tuner.search.feasibility import Hardware, resolve_model
    from kvpilot.tuner.search.settings import EngineSettings

    block_size = block_size or EngineSettings().block_size
    model = resolve_model(MODEL)
    dtype = Hardware(device_memory_bytes=1, shared_memory=True).engine_dtype(model)
    model = resolve_model(MODEL, dtype)
    blocks = max(CACHE_REQUESTS * math.ceil(longest_request_tokens / block_size), math.ceil(MAX_MODEL_LEN / block_size))
    return Cache(blocks, block_size, rank_kv_bytes_per_token(model, ParallelConfig(), 0), dtype)


def window_request_tokens(max_output_len: int, burst: int = BURST) -> list[int]:
    """prompt + output tokens of each request the tuner sends (the same sample, its warm-up
    request first: the guide's memory-model points size from all of them too)."""
    from kvpilot.loadgen.tokenizers import load_tokenizer
    from kvpilot.tuner.measure.workload import Workload, load_requests

    w = Workload(num_requests=burst, max_prompt_len=MAX_PROMPT, max_output_len=max_output_len,
                 warmup_requests=WARMUP_REQUESTS)
    load = load_requests(load_tokenizer(MODEL), w, MAX_MODEL_LEN)
    return [r.prompt_len + r.expected_output_len for r in load.requests]


def demo_engine(log_path: Path, serve_command: list[str] | None = None):
    """The engine the calibration runs and its default settings: `kvpilot serve`, or vLLM's
    `serve_command` (`vllm_runtime.vllm_serve_command`) with VLLM_ARGS, its CPU block size and
    a cache of CALIBRATION_KV_BYTES."""
    from kvpilot.tuner.local.engine_process import EngineProcess
    from kvpilot.tuner.search.settings import EngineSettings

    settings = EngineSettings(max_model_len=MAX_MODEL_LEN)
    if serve_command is None:
        return EngineProcess(MODEL, log_path, []), settings
    from kvpilot.tuner.local.vllm_runtime import VLLM_CPU_BLOCK_SIZE, vllm_engine

    return (vllm_engine(MODEL, log_path, serve_command, VLLM_ARGS),
            settings.replace(block_size=VLLM_CPU_BLOCK_SIZE, kv_cache_memory_bytes=CALIBRATION_KV_BYTES))


def calibrate(requests: int = 2, serve_command: list[str] | None = None) -> Calibration:
    """Serves `requests` demo requests of 16 tokens one at a time (after a warm-up)
    on the engine with its default settings (`demo_engine`: vLLM's with serve_command); raises
    RuntimeError when none succeeds, TrialFailed when the engine does not start."""
    from kvpilot.loadgen.tokenizers import load_tokenizer
    from kvpilot.tuner.measure.workload import Workload, drive, load_requests

    w = Workload(num_requests=requests, max_prompt_len=MAX_PROMPT, max_output_len=16, warmup_requests=1)
    load = load_requests(load_tokenizer(MODEL), w, MAX_MODEL_LEN)
    engine, settings = demo_engine(Path(tempfile.mkdtemp(prefix="kvpilot-demo-")) / "calibrate.log", serve_command)
    engine.start(settings)
    try:
        done = []
        for r in load.requests:  # the first one warms up
            done += [x for x in drive([r], w, engine.base_url, MODEL, engine.headers)[0] if x.success]
    finally:
        engine.stop()
    done = done[1:]
    if not done:
        raise RuntimeError("calibration: no request succeeded")
    return Calibration(statistics.median(r.ttft for r in done),
                       statistics.median((r.latency - r.ttft) / max(1, (r.output_tokens or 2) - 1) for r in done))


def demo_args(c: Calibration, cache: Cache, report_dir: Path, trials: int = 6, runtime: str = "kvpilot") -> list[str]:
    """`kvpilot tune --local` flags of the demo session: the defaults' cache is `cache`, and the
    search may give the cache up to KV_CACHE_GROWTH times its bytes (the guide's first remedy)
    besides lowering the limits (its second). runtime "vllm": on vLLM, with VLLM_ARGS."""
    kv = BY_NAME["kv_cache_memory_bytes"].flag
    engine = ["--runtime", "vllm", *(f"--engine-arg={a}" for a in VLLM_ARGS)] if runtime == "vllm" else []
    return ["--local", "--model", MODEL, BY_NAME["max_model_len"].flag, str(MAX_MODEL_LEN), *engine,
            f"--engine-arg={kv}={cache.kv_cache_memory_bytes}",
            "--trials", str(trials), "--remeasure-top", "1", "--report-dir", str(report_dir),
            *SEARCH, kv, f"{cache.kv_cache_memory_bytes}:{KV_CACHE_GROWTH * cache.kv_cache_memory_bytes}",
            *workload_args(c.max_output_len), *c.slo_args()]


def main(argv: list[str]) -> int:
    """Calibrates, sizes the cache, runs the session, prints the before/after table and
    writes its plot; extra argv flags override the demo's (e.g. --trials 3, --report-dir
    DIR); --runtime vllm [--vllm-python PATH] tells it on upstream vLLM. Returns 0 once the
    report is written, also when no trial met the SLOs (the report says so); 2 on bad flags
    or no vLLM found."""
    import argparse
    import logging

    from kvpilot.tuner.report import story
    from kvpilot.tuner.local.vllm_runtime import VLLM_CPU_BLOCK_SIZE, VLLMNotFound, vllm_serve_command

    p = argparse.ArgumentParser(prog="python -m kvpilot.tuner.demo", add_help=False)
    p.add_argument("--runtime", choices=RUNTIMES, default="kvpilot")
    p.add_argument("--vllm-python", default=None)
    known, rest = p.parse_known_args(argv)
    argv = rest + (["--vllm-python", known.vllm_python] if known.vllm_python else [])
    serve_command = None
    if known.runtime == "vllm":
        try:
            serve_command = vllm_serve_command(known.vllm_python)
        except VLLMNotFound as e:
            print(f"kvpilot demo: error: {e}", file=sys.stderr)
            return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    c = calibrate(serve_command=serve_command)
    sizes = window_request_tokens(c.max_output_len)
    cache = size_cache(max(sizes), VLLM_CPU_BLOCK_SIZE if serve_command else None)
    print(f"calibration (defaults, one request at a time): TTFT {c.ttft_s * 1000:.0f} ms, TPOT "
          f"{c.tpot_s * 1000:.0f} ms -> replies of {c.max_output_len} tokens (latency {c.latency_s:.1f} s); SLOs "
          f"{' '.join(c.slo_args())}\n"
          f"load: bursts of {BURST} ShareGPT requests ({min(sizes)}-{max(sizes)} tokens, mean "
          f"{statistics.fmean(sizes):.0f}); KV cache {cache.kv_cache_memory_bytes} bytes = {cache.num_blocks} blocks "
          f"of {cache.block_size} tokens at {cache.token_bytes} bytes/token ({cache.dtype} on this CPU): "
          f"{CACHE_REQUESTS} of the longest requests at once, while the burst's {sum(sizes)} tokens would all run "
          f"at once with the defaults",
          file=sys.stderr, flush=True)
    report_dir = Path(tempfile.mkdtemp(prefix="kvpilot-demo-tune-"))
    code = cli.main(demo_args(c, cache, report_dir, runtime=known.runtime) + list(argv))
    if code not in (0, 1):
        return code
    folder = Path(next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--report-dir"), report_dir))
    rep = json.loads((folder / "report.json").read_text())
    evidence, what = PREEMPTION_LOG[known.runtime]
    warnings = [line for line in (folder / "engine.log").read_text().splitlines() if evidence in line]
    if warnings:
        print(f"engine log: {len(warnings)} {what}, the first:\n  {warnings[0]}")
    print(story.before_after(rep))
    plot = story.write_plot(rep, folder)
    print(f"plot: {plot}" if plot else "plot: none (no winner to compare)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
