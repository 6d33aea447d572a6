"""GGUF path, 4 ShareGPT prompts of ~700-1000 tokens decoding together: seconds for 64 output
tokens each with the decode stack serving those steps (its attention on 2 OpenMP threads, now) and
with the stack declining them when their attention would take threads (before c073d44: the
per-module path ran them), alternated 3 rounds in one process (README section 11).

usage: gguf_stack_threads.py
"""
import os, time, statistics
import torch
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.attention import cpu_decode
from kvpilot.engine.layers.cpu_decode_stack import DecodeStack
from kvpilot.engine.model_loader import resolve_model_path
from kvpilot.bench.datasets import sample_sharegpt_requests

torch.set_num_threads(2)
llm = LLM("smollm2-135m-instruct", quantization="gguf", dtype="float32", max_model_len=2048, max_num_seqs=8)
reqs = [r for r in sample_sharegpt_requests(llm.get_tokenizer(), 200, seed=0) if 700 <= r.prompt_len <= 1000][:4]
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
forward = DecodeStack.forward
mode = ["now"]

def gated(self, input_ids, positions, kv_caches, meta):
    if mode[0] == "before" and cpu_decode.attention_threads(meta.seq_lens_cpu, self.num_kv_heads) > 1:
        return None
    return forward(self, input_ids, positions, kv_caches, meta)

DecodeStack.forward = gated
llm.generate([r.prompt for r in reqs], SamplingParams(max_tokens=4))  # warm-up
times = {"now": [], "before": []}
for _ in range(3):
    for m in ("now", "before"):
        mode[0] = m
        t = time.perf_counter(); llm.generate([r.prompt for r in reqs], params); times[m].append(time.perf_counter() - t)
print("prompt tokens", [r.prompt_len for r in reqs], "load", os.getloadavg())
for m, v in times.items():
    print(f"{m}: median {statistics.median(v):.2f} s  runs {[round(x, 2) for x in v]}")
