"""One stream (and a batch of 4), side by side, interleaved (section 6c): kvpilot fp32 `--quantization
gguf` (q8_1 activations, the default) with the C decode stack on (`stack`: all layers of a decode step
in one C call, engine/layers/cpu_decode_stack.py) and off (`modules`: layer by layer, as before), one
engine toggled by DecodeStack.enabled, and llama.cpp (llama-cpp-python, a persistent subprocess of the interpreter given as
LLAMA_PY, -I so the repo's folders do not shadow stdlib modules) on the same GGUF, at 1 and 2
threads. Same prompt token ids everywhere (a ShareGPT chat prompt), greedy, 48 new tokens (EOS
ignored by us, never reached by llama.cpp's loop which stops at 48); decode ms per token =
(run(48) - run(1)) / 47 in each of 5 rounds, median (and min) over rounds. The batch of 4 (kvpilot
only: 4 ShareGPT prompts decoding together) gives ms per decode step the same way.
Usage: LLAMA_PY=/path/to/python python gguf_stack_single_stream.py OUT.json"""
import json, os, statistics, subprocess, sys, time
import torch
from kvpilot.bench.datasets import sharegpt_pairs
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu_info import detect_cpu
from kvpilot.engine.layers.cpu_decode_stack import DecodeStack
from kvpilot.engine.model_loader import builtin_gguf_path

N, ROUNDS, MODEL = 48, 5, "smollm2-135m-instruct"
common = dict(dtype="float32", quantization="gguf", max_model_len=1024, max_num_seqs=4,
              num_gpu_blocks_override=128, swap_space=0)
os.environ.pop("KVPILOT_GGUF_ACTIVATIONS", None)
llm = LLM(MODEL, **common)
assert llm.engine.runner.model.decode_stack is not None
engines = {"kvpilot gguf modules": False, "kvpilot gguf stack": True}
tok = llm.get_tokenizer()


def chat_ids(prompt):
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


prompts = [chat_ids(p) for p, _ in sharegpt_pairs() if 8 <= len(tok.encode(p, add_special_tokens=False)) <= 40][:4]
ids = prompts[0]

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


def run(name, threads, n, batch=1):
    """(wall s, cpu s, tokens of the first request) of `batch` requests of n new tokens."""
    if name == "llama.cpp":
        llama.stdin.write(json.dumps([threads, n, ids]) + "\n")
        llama.stdin.flush()
        return tuple(json.loads(llama.stdout.readline()))
    torch.set_num_threads(threads)
    DecodeStack.enabled = engines[name]
    w, c = time.perf_counter(), time.process_time()
    out = llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
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
        for name in engines:  # 4 streams decoding together: ms per step
            (w1, c1, _), (w, c, _) = run(name, threads, 1, 4), run(name, threads, N, 4)
            res.setdefault(f"{name}, batch 4, {threads} thread(s)", []).append(
                {"wall_ms_per_token": (w - w1) / (N - 1) * 1e3, "cpu_ms_per_token": (c - c1) / (N - 1) * 1e3,
                 "loadavg": os.getloadavg()[0]})
summary = {k: {"median_wall_ms_per_token": statistics.median(r["wall_ms_per_token"] for r in v),
               "min_wall_ms_per_token": min(r["wall_ms_per_token"] for r in v),
               "median_cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in v)} for k, v in res.items()}
first_diff = {name: next((i for i, (a, b) in enumerate(zip(tokens["kvpilot gguf modules"], t)) if a != b), None)
              for name, t in tokens.items()}
with open(sys.argv[1], "w") as f:
    json.dump({"cpu": detect_cpu().model_name, "prompt_tokens": len(ids), "new_tokens": N,
               "first_token_differing_from_modules": first_diff, "loadavg_before": loadavg_before,
               "loadavg_after": os.getloadavg(), "summary": summary, "rounds": res}, f, indent=2)
print(json.dumps(summary, indent=1), "first differing token vs modules:", first_diff)
if llama:
    llama.stdin.close()
    llama.wait()
