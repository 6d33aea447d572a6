"""One stream with `--quantization gguf`, fp32, 1 thread: the C kernels of issue 15d 'on'
(fused RoPE + K/V write + attention, RMSNorm with the residual add, SiLU-and-mul) against
'unfused' (the decode attention alone in C, the previous op sequence), two engines in one
process, interleaved; 48 greedy tokens of a ShareGPT chat prompt, decode ms per token =
(run(48) - run(1)) / 47, median of the rounds. Usage: python gguf_fused_single_stream.py OUT.json"""
import json
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(1)
from kvpilot.bench.datasets import sharegpt_pairs  # noqa: E402
from kvpilot.bench.decode_step import _set_cpu_kernel  # noqa: E402
from kvpilot.engine import LLM, SamplingParams  # noqa: E402

N, ROUNDS = 48, 5
common = dict(dtype="float32", quantization="gguf", max_model_len=1024, max_num_seqs=4,
              num_gpu_blocks_override=128, swap_space=0)
engines = {m: LLM("smollm2-135m-instruct", **common) for m in ("on", "unfused")}
for m, llm in engines.items():
    _set_cpu_kernel(llm, m)
chat = next(p for p, _ in sharegpt_pairs() if 8 <= len(p.split()) <= 30)
ids = engines["on"].apply_chat_template([{"role": "user", "content": chat}])
greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def run(llm, n):
    greedy.max_tokens = n
    return llm.generate([ids], greedy)[0].outputs[0].token_ids


before = os.getloadavg()
same = run(engines["on"], N) == run(engines["unfused"], N)
res = {m: {"cpu": [], "wall": []} for m in engines}
for _ in range(ROUNDS):
    for m, llm in engines.items():
        t = {}
        for n in (1, N):
            c, w = time.process_time(), time.perf_counter()
            run(llm, n)
            t[n] = (time.process_time() - c, time.perf_counter() - w)
        res[m]["cpu"].append((t[N][0] - t[1][0]) / (N - 1) * 1e3)
        res[m]["wall"].append((t[N][1] - t[1][1]) / (N - 1) * 1e3)
summary = {m: {"median_cpu_ms_per_token": statistics.median(v["cpu"]),
               "median_wall_ms_per_token": statistics.median(v["wall"])} for m, v in res.items()}
print(json.dumps(summary, indent=1), "greedy tokens equal:", same)
with open(sys.argv[1], "w") as f:
    json.dump({"loadavg_before": before, "loadavg_after": os.getloadavg(), "greedy_tokens_equal": same,
               "threads": 1, "summary": summary, "rounds": res}, f, indent=2)
