"""One stream, side by side, interleaved in one process: kvpilot fp32 with dense weights vs
fp32 with `--quantization gguf` (Q4_1/Q8_0 blocks for decode matmuls), at 1 and 2 threads.
Chat prompt from ShareGPT, 48 new tokens (greedy, ignore_eos); CPU and wall ms per token,
decode only: (run(48) - run(1)) / 47 in each of 5 interleaved rounds, median (and min) over rounds. Usage: python gguf_single_stream.py OUT.json"""
import json, os, sys, time, torch
os.environ.setdefault("KVPILOT_GGUF_ACTIVATIONS", "float32")  # section 6's figures; 6b's script measures q8_1
from kvpilot.engine import LLM, SamplingParams
from kvpilot.bench.datasets import sharegpt_pairs
from kvpilot.engine.cpu_info import detect_cpu
N = 48
common = dict(dtype="float32", max_model_len=1024, max_num_seqs=4, num_gpu_blocks_override=128, swap_space=0)
engines = {"dense fp32": LLM("smollm2-135m-instruct", **common),
           "gguf (Q4_1/Q8_0 blocks)": LLM("smollm2-135m-instruct", quantization="gguf", **common)}
tok = engines["dense fp32"].get_tokenizer()
prompt = next(p for p, _ in sharegpt_pairs() if 8 <= len(tok.encode(p, add_special_tokens=False)) <= 40)
ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
def run(llm, n):
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
loadavg_before = os.getloadavg()
same = run(engines["dense fp32"], N) == run(engines["gguf (Q4_1/Q8_0 blocks)"], N)
ROUNDS = 5
res = {}
for _ in range(ROUNDS):
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, llm in engines.items():
            run(llm, 2)
            r = {}
            for n in (1, N):
                c, w = time.process_time(), time.perf_counter(); run(llm, n)
                r[f"cpu_s_{n}"], r[f"wall_s_{n}"] = time.process_time() - c, time.perf_counter() - w
            res.setdefault(f"{name}, {threads} thread(s)", []).append(r)
            print(name, threads, r, os.getloadavg(), flush=True)
def per_round(v, kind):
    return sorted((r[f"{kind}_s_{N}"] - r[f"{kind}_s_1"]) / (N - 1) * 1e3 for r in v)
summary = {k: {"median_cpu_ms_per_token": per_round(v, "cpu")[ROUNDS // 2],
               "median_wall_ms_per_token": per_round(v, "wall")[ROUNDS // 2],
               "min_wall_ms_per_token": per_round(v, "wall")[0]} for k, v in res.items()}
json.dump({"cpu": detect_cpu().model_name, "prompt_tokens": len(ids), "new_tokens": N,
           "greedy_tokens_equal": same, "loadavg_before": loadavg_before, "loadavg_after": os.getloadavg(),
           "summary": summary, "rounds": res}, open(sys.argv[1], "w"), indent=2)
print(json.dumps(summary, indent=1), "greedy equal:", same)
