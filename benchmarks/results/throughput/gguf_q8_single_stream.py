"""One stream, side by side, interleaved: kvpilot fp32 `--quantization gguf` with 8-bit activations
(q8_1, the default) vs float32 activations (KVPILOT_GGUF_ACTIVATIONS=float32), two engines in one
process, and llama.cpp (llama-cpp-python, a persistent subprocess of the interpreter given as
LLAMA_PY, -I so the repo's folders do not shadow stdlib modules) on the same GGUF, at 1 and 2
threads. Same prompt token ids everywhere (a ShareGPT chat prompt), greedy, 48 new tokens (EOS
ignored by us, never reached by llama.cpp's loop which stops at 48); decode ms per token =
(run(48) - run(1)) / 47 in each of 5 rounds, median (and min) over rounds.
Usage: LLAMA_PY=/path/to/python python gguf_q8_single_stream.py OUT.json"""
import json, os, statistics, subprocess, sys, time
import torch
from kvpilot.bench.datasets import sharegpt_pairs
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu_info import detect_cpu
from kvpilot.engine.model_loader import builtin_gguf_path

N, ROUNDS, MODEL = 48, 5, "smollm2-135m-instruct"
common = dict(dtype="float32", quantization="gguf", max_model_len=1024, max_num_seqs=4,
              num_gpu_blocks_override=128, swap_space=0)
engines = {}
for act in ("q8_1", "float32"):
    os.environ["KVPILOT_GGUF_ACTIVATIONS"] = act  # read once per engine at load
    engines[f"kvpilot gguf {act}"] = LLM(MODEL, **common)
tok = engines["kvpilot gguf q8_1"].get_tokenizer()
prompt = next(p for p, _ in sharegpt_pairs() if 8 <= len(tok.encode(p, add_special_tokens=False)) <= 40)
ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)

LLAMA = r"""
import json, sys, time
from llama_cpp import Llama
llms = {t: Llama(model_path=sys.argv[1], n_ctx=1024, n_threads=t, n_batch=512, verbose=False) for t in (1, 2)}
for line in sys.stdin:
    threads, n, ids = json.loads(line)
    w, c = time.perf_counter(), time.process_time()
    out = []
    for t in llms[threads].generate(ids, top_k=1, temp=0.0, reset=True):
        out.append(t)
        if len(out) == n:
            break
    print(json.dumps([time.perf_counter() - w, time.process_time() - c, out]), flush=True)
"""
llama = None
if os.environ.get("LLAMA_PY"):
    llama = subprocess.Popen([os.environ["LLAMA_PY"], "-I", "-c", LLAMA, str(builtin_gguf_path(MODEL))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")


def run(name, threads, n):
    """(wall s, cpu s, tokens) of one request of n new tokens."""
    if name == "llama.cpp":
        llama.stdin.write(json.dumps([threads, n, ids]) + "\n")
        llama.stdin.flush()
        return tuple(json.loads(llama.stdout.readline()))
    torch.set_num_threads(threads)
    w, c = time.perf_counter(), time.process_time()
    out = engines[name].generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - w, time.process_time() - c, list(out[0].outputs[0].token_ids)


names = [*engines, *(["llama.cpp"] if llama else [])]
loadavg_before = os.getloadavg()
tokens = {name: run(name, 1, N)[2] for name in names}
res = {}
for _ in range(ROUNDS):
    for threads in (1, 2):
        for name in names:
            run(name, threads, 2)
            (w1, c1, _), (w, c, _) = run(name, threads, 1), run(name, threads, N)
            res.setdefault(f"{name}, {threads} thread(s)", []).append(
                {"wall_ms_per_token": (w - w1) / (N - 1) * 1e3, "cpu_ms_per_token": (c - c1) / (N - 1) * 1e3,
                 "loadavg": os.getloadavg()[0]})
            print(name, threads, res[f"{name}, {threads} thread(s)"][-1], flush=True)
summary = {k: {"median_wall_ms_per_token": statistics.median(r["wall_ms_per_token"] for r in v),
               "min_wall_ms_per_token": min(r["wall_ms_per_token"] for r in v),
               "median_cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in v)} for k, v in res.items()}
first_diff = {name: next((i for i, (a, b) in enumerate(zip(tokens["kvpilot gguf float32"], t)) if a != b), None)
              for name, t in tokens.items()}
with open(sys.argv[1], "w") as f:
    json.dump({"cpu": detect_cpu().model_name, "prompt_tokens": len(ids), "new_tokens": N,
               "first_token_differing_from_gguf_float32": first_diff, "loadavg_before": loadavg_before,
               "loadavg_after": os.getloadavg(), "summary": summary, "rounds": res}, f, indent=2)
print(json.dumps(summary, indent=1), "first differing token vs float32:", first_diff)
if llama:
    llama.stdin.close()
    llama.wait()
