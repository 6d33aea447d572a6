"""Run by test_malloc_policy.py in a fresh interpreter: the builtin model's prefill steps of 2,048
tokens (max_num_batched_tokens), with engine/cpu/malloc_policy.apply() as the model runner calls it
(argv[1] "apply") or switched off ("none"); prints the minor page faults per step after two warm-up
steps."""

from __future__ import annotations

import resource
import sys

import kvpilot.engine  # noqa: F401  (the OpenMP wait policy before torch loads)
from kvpilot.engine import SamplingParams
from kvpilot.engine.cpu import malloc_policy
from kvpilot.engine.entrypoints.llm import LLM

if sys.argv[1] == "none":
    malloc_policy.apply = lambda environ=None: False
llm = LLM("smollm2-135m-instruct", dtype="bfloat16", quantization="none", max_model_len=2048,
          enable_prefix_caching=False, num_gpu_blocks_override=1024, swap_space=0)
engine = llm.engine
for i in range(24):
    engine.add_request(f"r{i}", " ".join(f"word{i}x{j}" for j in range(170)), SamplingParams(max_tokens=1))
faults = []
while engine.has_unfinished_requests():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(" ".join(map(str, faults[2:])))
