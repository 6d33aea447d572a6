"""`make demo`'s tuning part: a short local session on the builtin SmolLM2 with ShareGPT load
against SLOs calibrated on this machine, printing the best settings against the defaults.

The scenario is the one vLLM's tuning guide warns about: the KV cache is small
(--num-gpu-blocks-override 24, 384 tokens, about three of the demo's requests) and the
defaults admit up to 256 sequences, so when requests pile up they are preempted and
re-prefilled; the SLO allows no preemptions. The tuner searches the scheduler limits,
which the engine changes live, so the session starts the engine once.

The SLOs come from a quick measurement first (`calibrate`): the engine with its defaults
serves a few demo requests one at a time, giving the unloaded TTFT, TPOT and request
latency L on this machine (CPUs differ by 10x, and a shared machine by more). Then:
  request rate  = 1.5 / L (about 1.5 requests in flight: the cache holds that, not bursts);
  p95 TTFT SLO  = unloaded TTFT + 1.5 x L (a request may wait for about one ahead of it,
                  the price of admitting no more than the cache holds);
  p95 ITL SLO   = unloaded TTFT + 2 x unloaded TPOT (a token may wait for one other
                  request's prefill step, about the unloaded TTFT, and its own decode
                  step); no preemptions.
So the winner's TTFT is a few request-times, something a user of this machine accepts,
not a 60 s placeholder. The ITL bound allows one prefill stall per gap on purpose: with
about 1.5 requests in flight, 2-4 % of a request's gaps hold another request's prefill,
so a p95 ITL bound below the prefill time (the earlier 4 x TPOT) sat inside the run-to-run
spread and the same settings met it in one window and broke it in the next.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.settings import BY_NAME, flag_words
from kvpilot.tuner import cli

MODEL, MAX_MODEL_LEN, KV_BLOCKS = "smollm2-135m-instruct", 256, 24  # 24 blocks hold 1.5 max_model_len
MAX_PROMPT, MAX_OUTPUT = 128, 48
DEMO_ARGS = [
    "--local", "--model", MODEL, BY_NAME["max_model_len"].flag, str(MAX_MODEL_LEN),
    f"--engine-arg={BY_NAME['num_gpu_blocks_override'].flag}={KV_BLOCKS}",
    "--trials", "6", "--remeasure-top", "1",
    "--num-requests", "10", "--max-prompt-len", str(MAX_PROMPT), "--max-output-len", str(MAX_OUTPUT),
    "--warmup-requests", "1",
    BY_NAME["max_num_batched_tokens"].flag, "128:1024", BY_NAME["max_num_seqs"].flag, "2:256",
    "--chunked-prefill", "on",
    "--max-preemptions-per-min", "0",
]


@dataclass(frozen=True)
class Calibration:
    """Medians of requests served one at a time by the default engine (seconds)."""

    ttft_s: float
    tpot_s: float
    latency_s: float

    def args(self) -> list[str]:
        """The demo's SLO and load flags (see the module doc)."""
        return ["--slo-ttft-ms", f"{(self.ttft_s + 1.5 * self.latency_s) * 1000:.0f}",
                "--slo-itl-ms", f"{(self.ttft_s + 2 * self.tpot_s) * 1000:.0f}",
                "--request-rate", f"{1.5 / self.latency_s:.3f}"]


def calibrate(requests: int = 3) -> Calibration:
    """Serves `requests` demo requests one at a time (after a warm-up) on the engine with
    its default settings and the demo's cache; raises TrialFailed when it does not start."""
    from kvpilot.bench.tokenizers import load_tokenizer
    from kvpilot.tuner.engine_process import EngineProcess
    from kvpilot.tuner.settings import EngineSettings
    from kvpilot.tuner.workload import Workload, drive, load_requests

    w = Workload(num_requests=requests, max_prompt_len=MAX_PROMPT, max_output_len=MAX_OUTPUT, warmup_requests=1)
    load = load_requests(load_tokenizer(MODEL), w, MAX_MODEL_LEN)
    engine = EngineProcess(MODEL, Path(tempfile.mkdtemp(prefix="kvpilot-demo-")) / "calibrate.log",
                           flag_words("num_gpu_blocks_override", KV_BLOCKS))
    engine.start(EngineSettings(max_model_len=MAX_MODEL_LEN))
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
                       statistics.median((r.latency - r.ttft) / max(1, (r.output_tokens or 2) - 1) for r in done),
                       statistics.median(r.latency for r in done))


def main(argv: list[str]) -> int:
    """Calibrates, then runs the demo session; extra argv flags override the demo's (e.g.
    --trials 3, --report-dir DIR). Returns 0 once the report is written, also when no
    trial met the SLOs (the report says so); 2 on bad flags."""
    c = calibrate()
    print(f"calibration (defaults, one request at a time): TTFT {c.ttft_s * 1000:.0f} ms, "
          f"TPOT {c.tpot_s * 1000:.0f} ms, latency {c.latency_s:.1f} s -> {' '.join(c.args())}",
          file=sys.stderr, flush=True)
    code = cli.main(DEMO_ARGS + c.args() + list(argv))
    return 0 if code in (0, 1) else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
