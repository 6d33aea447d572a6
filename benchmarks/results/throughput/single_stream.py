"""One stream, side by side, interleaved: kvpilot fp32, kvpilot bf16, HF generate fp32.
Chat prompt from ShareGPT, 48 new tokens (greedy, ignore_eos), 1 thread; CPU and wall s per token."""
import json, os, sys, time, torch
torch.set_num_threads(1)
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model_loader import resolve_model_path
from kvpilot.bench.datasets import sharegpt_pairs
from transformers import AutoModelForCausalLM
N = 48
path = resolve_model_path("smollm2-135m-instruct")
engines = {d: LLM(str(path), dtype=d, max_model_len=1024, max_num_seqs=4, num_gpu_blocks_override=128, swap_space=0)
           for d in ("float32", "bfloat16")}
tok = engines["float32"].get_tokenizer()
prompt = next(p for p, _ in sharegpt_pairs() if 8 <= len(tok.encode(p, add_special_tokens=False)) <= 40)
ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
def ours(llm):
    def run(n):
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return run
def hf_run(n):
    with torch.inference_mode():
        hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
runs = {"kvpilot float32": ours(engines["float32"]), "kvpilot bfloat16": ours(engines["bfloat16"]), "HF generate float32": hf_run}
for f in runs.values(): f(4)
res = {k: [] for k in runs}
for _ in range(3):
    for k, f in runs.items():
        # decode time = run(N) - run(1) (removes the prefill)
        c, w = time.process_time(), time.perf_counter(); f(1); c1, w1 = time.process_time() - c, time.perf_counter() - w
        c, w = time.process_time(), time.perf_counter(); f(N); cN, wN = time.process_time() - c, time.perf_counter() - w
        res[k].append({"cpu_ms_per_token": (cN - c1) / (N - 1) * 1e3, "wall_ms_per_token": (wN - w1) / (N - 1) * 1e3})
        print(k, res[k][-1], flush=True)
summary = {k: {"median_cpu_ms_per_token": sorted(r["cpu_ms_per_token"] for r in v)[1],
               "median_wall_ms_per_token": sorted(r["wall_ms_per_token"] for r in v)[1]} for k, v in res.items()}
json.dump({"prompt_tokens": len(ids), "new_tokens": N, "threads": 1, "loadavg_after": os.getloadavg(),
           "summary": summary, "rounds": res}, open(sys.argv[1], "w"), indent=2)
print(json.dumps(summary, indent=1))
