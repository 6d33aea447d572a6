"""Where an offline float32 run's time goes, by the number of running sequences: the same
32 ShareGPT requests as `bench throughput`, all queued at once (reference output lengths,
`ignore_eos`), stepped by hand; per step the wall time of the linear layers (every
`_Linear.matmul`: qkv, o, gate_up, down and the LM head), of the attention backend (KV write
and paged attention), and of the model forward and `compute_logits`, plus the KV bytes the
decode rows read (sum of context lengths x 2 x KV heads x head_dim x 4 bytes x layers).
Prints a table, writes JSON. DTYPE=bfloat16 runs a bfloat16 engine (default float32). QUANT=gguf runs `--quantization gguf` with float32 activations;
there the decode stack serves decode-only steps in one C call, so their linear and attention
columns stay empty unless KVPILOT_DECODE_STACK=0.

    [DTYPE=bfloat16] [QUANT=gguf] .venv/bin/python benchmarks/results/throughput/offline_step_breakdown.py [num_prompts] [out.json]
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time

import torch

from kvpilot.bench.datasets import sample_sharegpt_requests
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu_info import detect_cpu
from kvpilot.engine.layers import linear
from kvpilot.engine.models import llama

BUCKETS = ((24, "24-32"), (9, "9-23"), (2, "2-8"), (1, "1"))  # decode-only steps by running sequences
PREFILL = "steps with prefill tokens"


def timed(acc: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t
    return wrapper


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    out = sys.argv[2] if len(sys.argv) > 2 else "offline_step_breakdown.json"
    quant = os.environ.get("QUANT") or None
    if quant:
        os.environ.setdefault("KVPILOT_GGUF_ACTIVATIONS", "float32")
    dtype = os.environ.get("DTYPE", "float32")
    llm = LLM("smollm2-135m-instruct", dtype=dtype, max_model_len=2048, quantization=quant)
    eng, cfg = llm.engine, llm.engine.config.model
    acc: dict[str, float] = collections.defaultdict(float)
    linear._Linear.matmul = timed(acc, "matmul_s", linear._Linear.matmul)
    backend = type(eng.runner.model.layers[0].self_attn.backend)
    backend.forward_qkv = timed(acc, "attention_s", backend.forward_qkv)
    llama.LlamaForCausalLM.forward = timed(acc, "forward_s", llama.LlamaForCausalLM.forward)
    llama.LlamaForCausalLM.compute_logits = timed(acc, "logits_s", llama.LlamaForCausalLM.compute_logits)
    kv_bytes_per_token = 2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers * (2 if dtype == "bfloat16" else 4)
    reqs = sample_sharegpt_requests(llm.get_tokenizer(), n, seed=0)
    for i, r in enumerate(reqs):
        eng.add_request(str(i), r.prompt, SamplingParams(temperature=0, max_tokens=r.expected_output_len,
                                                         ignore_eos=True))
    buckets = {name: collections.defaultdict(float) for name in (PREFILL, *(name for _, name in BUCKETS))}
    load = [os.getloadavg()[0]]
    while eng.has_unfinished_requests():
        acc.clear()
        seqs = [*eng.scheduler.running, *eng.scheduler.waiting]
        prefill = any(s.num_computed_tokens < len(s.prompt_token_ids) for s in seqs)
        kv_read = sum(s.num_tokens for s in seqs) * kv_bytes_per_token
        t = time.perf_counter()
        eng.step()
        b = buckets[PREFILL if prefill else next(name for low, name in BUCKETS if len(seqs) >= low)]
        b["steps"] += 1
        b["step_s"] += time.perf_counter() - t
        b["kv_read_bytes"] += kv_read
        for k, v in acc.items():
            b[k] += v
    load.append(os.getloadavg()[0])
    rows = {}
    print("| running sequences | steps | s in all | ms/step | linear layers ms | attention ms | other in forward ms "
          "| logits ms | outside the model ms | K/V read GB/s (decode) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, b in buckets.items():
        if not b["steps"]:
            continue
        per = {k: 1000 * v / b["steps"] for k, v in b.items() if k.endswith("_s")}
        # the LM head's matmul runs in compute_logits, outside the forward: take it out of the linear time
        other = per["forward_s"] - per.get("attention_s", 0) - (per.get("matmul_s", 0) - per.get("logits_s", 0))
        rows[name] = {"steps": int(b["steps"]), "total_s": b["step_s"], **{k.replace("_s", "_ms"): v for k, v in per.items()},
                      # None where no attention call was timed (prefill steps, steps the decode stack served)
                      "kv_read_gb_per_s": b["kv_read_bytes"] / b["attention_s"] / 1e9
                      if b["attention_s"] and name != PREFILL else None}
        print(f"| {name} | {int(b['steps'])} | {b['step_s']:.1f} | {per['step_s']:.1f} | {per.get('matmul_s', 0):.1f} "
              f"| {per.get('attention_s', 0):.1f} | {max(0.0, other):.1f} | {per.get('logits_s', 0):.1f} "
              f"| {per['step_s'] - per['forward_s'] - per.get('logits_s', 0):.1f} "
              f"| {_gbps(rows[name]['kv_read_gb_per_s'])} |")
    with open(out, "w") as f:
        json.dump({"cpu": detect_cpu().as_dict(), "torch_threads": torch.get_num_threads(), "num_prompts": n, "dtype": dtype,
                   "quantization": quant, "gguf_activations": os.environ.get("KVPILOT_GGUF_ACTIVATIONS"),
                   "loadavg_1min": load, "buckets": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
