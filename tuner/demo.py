"""`make demo`'s tuning part: a short local session on the builtin SmolLM2 with ShareGPT load
against example SLOs, printing the best settings against the engine defaults.

The scenario is the one vLLM's tuning guide warns about: the KV cache is small
(--num-gpu-blocks-override 48, 768 tokens) and the defaults admit up to 256 sequences,
so a burst of requests gets preempted and re-prefilled; the SLO allows no preemptions.
The tuner searches the scheduler limits, which the engine changes live, so the session
starts the engine once. 8 trials and one re-measurement: about 5 minutes on a 2-core CPU.
"""

from __future__ import annotations

import sys

from kvpilot.tuner import cli

DEMO_ARGS = [
    "--local", "--model", "smollm2-135m-instruct", "--max-model-len", "512",
    "--engine-arg=--num-gpu-blocks-override=48",
    "--trials", "8", "--remeasure-top", "1",
    "--num-requests", "10", "--max-prompt-len", "128", "--max-output-len", "64", "--warmup-requests", "1",
    "--max-num-batched-tokens", "128:1024", "--max-num-seqs", "2:256", "--chunked-prefill", "on",
    "--slo-ttft-ms", "60000", "--slo-itl-ms", "1000", "--max-preemptions-per-min", "0",
]


def main(argv: list[str]) -> int:
    """Runs the demo session; extra argv flags override the demo's (e.g. --trials 3,
    --report-dir DIR). Returns 0 once the report is written, also when no trial met the
    SLOs (the report says so); 2 on bad flags."""
    code = cli.main(DEMO_ARGS + list(argv))
    return 0 if code in (0, 1) else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
