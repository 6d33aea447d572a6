"""Decode-step CPU and wall time of engines with the CPU C kernels in different modes
(`bench decode-step --cpu-kernel` modes: on = fused RoPE + K/V write + attention, RMSNorm
with the residual add, SiLU-and-mul; unfused = only the decode attention in C, the op
sequence before the fusion; off = torch only), one process, interleaved round by round,
beside the matmul floor (every linear layer and the LM head alone on the step's shapes).

usage: fused_breakdown.py BATCHES MODES OUT.json [PROMPT_LEN] [ROUNDS] [STEPS]
"""
import json
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(1)
from kvpilot.bench.decode_step import _drain, _engine, _fill, _set_cpu_kernel, _sharegpt_prompts  # noqa: E402
from kvpilot.engine.layers.linear import _Linear  # noqa: E402

batches = [int(b) for b in sys.argv[1].split(",")]
modes = sys.argv[2].split(",")
prompt_len = int(sys.argv[4]) if len(sys.argv) > 4 else 128
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 5
steps = int(sys.argv[6]) if len(sys.argv) > 6 else 4
engines = {}
for m in modes:
    engines[m] = _engine("smollm2-135m-instruct", "float32", max(batches), prompt_len, rounds * steps + 4)
    _set_cpu_kernel(engines[m], m)
prompts = _sharegpt_prompts(engines[modes[0]].get_tokenizer(), max(batches), prompt_len)
out = {"loadavg_before": os.getloadavg(), "prompt_len": prompt_len, "rounds": rounds, "steps": steps,
       "torch_threads": 1, "results": {}}
for batch in batches:
    cpu = {m: [] for m in modes}
    wall = {m: [] for m in modes}
    for m, llm in engines.items():
        _fill(llm, prompts[:batch], f"b{batch}")
        for _ in range(2):
            llm.engine.step()
    for _ in range(rounds):
        for m, llm in engines.items():
            for _ in range(steps):
                w, c = time.perf_counter(), time.process_time()
                llm.engine.step()
                wall[m].append(1e3 * (time.perf_counter() - w))
                cpu[m].append(1e3 * (time.process_time() - c))
    runner = engines[modes[0]].engine.runner
    lins = [m for m in runner.model.modules() if isinstance(m, _Linear) and m is not runner.model.embed_tokens]
    xs = [torch.randn(batch, m.weight.shape[1]) for m in lins]
    head = runner.model.lm_head
    hx = torch.randn(batch, head.weight.shape[1])
    floor = []
    with torch.inference_mode():
        for _ in range(5):
            c = time.process_time()
            for m, x in zip(lins, xs):
                m.matmul(x)
            head.matmul(hx)
            floor.append(1e3 * (time.process_time() - c))
    row = {"matmul_floor_cpu_ms": statistics.median(floor)}
    for m in modes:
        row[m] = {"step_cpu_ms": statistics.median(cpu[m]), "step_wall_ms": statistics.median(wall[m]),
                  "cpu_ms_all": cpu[m]}
        _drain(engines[m], batch, f"b{batch}")
    out["results"][str(batch)] = row
    print(batch, {k: (v if not isinstance(v, dict) else {a: round(b, 1) for a, b in v.items() if a != "cpu_ms_all"})
                  for k, v in row.items()}, flush=True)
out["loadavg_after"] = os.getloadavg()
with open(sys.argv[3], "w") as f:
    json.dump(out, f, indent=2)
