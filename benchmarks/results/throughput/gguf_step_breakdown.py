"""Where one decode step of one stream goes on the float32 `--quantization gguf` path
(section 6c): one engine, in-process `LLM.generate`, greedy, N new tokens after a ShareGPT
chat prompt, 1 and 2 threads. The engine's own functions are wrapped (in this script only)
with perf_counter_ns timers; each timer adds ~0.3 us per call, listed as
`timer_overhead_ms`. Parts per decoded token (ms), nested:
  step             LLMEngine.step (schedule + execute + commit/detokenize/outputs)
    execute        ModelRunner.execute
      prepare      ModelRunner._prepare (input tensors, attention metadata)
      forward      LlamaForCausalLM.forward
        matmul_c   the GGUF kernel's C calls (kvp_gguf_matmul)
        attn_c     the fused decode-attention C calls (kvp_rope_cache_decode_f32)
        norm_act_c the RMSNorm and SiLU*mul C calls
        stack_c    the C decode stack's one call (layers/cpu_decode_stack.py): all of the above
      logits       compute_logits (the LM head matmul_c included: listed apart as lm_head_c)
      sample       Sampler.__call__
  outside_step     generate()'s wall time per token minus step
Each part is measured with the decode stack off (`modules`: every layer through its nn.Modules)
and on (`stack`), interleaved round by round in one process; medians over rounds.
Usage: python gguf_step_breakdown.py OUT.json"""
import json, os, statistics, sys, time
import torch
from kvpilot.bench.datasets import sharegpt_pairs
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.attention import cpu_decode
from kvpilot.engine.cpu_info import detect_cpu
from kvpilot.engine.layers import cpu_ops, gguf_kernel
from kvpilot.engine.layers.cpu_decode_stack import DecodeStack
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.sampler import Sampler

N, ROUNDS = 64, 5
llm = LLM("smollm2-135m-instruct", dtype="float32", quantization="gguf", max_model_len=1024, max_num_seqs=4,
          num_gpu_blocks_override=128, swap_space=0)
tok = llm.get_tokenizer()
prompt = next(p for p, _ in sharegpt_pairs() if 8 <= len(tok.encode(p, add_special_tokens=False)) <= 40)
ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)

acc: dict[str, int] = {}
calls: dict[str, int] = {}
state = {"in_logits": False}


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            key = "lm_head_c" if name == "matmul_c" and state["in_logits"] else name
            acc[key] = acc.get(key, 0) + time.perf_counter_ns() - t
            calls[key] = calls.get(key, 0) + 1
    return wrapper


def logits_wrapper(fn):
    def wrapper(*a, **k):
        state["in_logits"] = True
        try:
            return fn(*a, **k)
        finally:
            state["in_logits"] = False
    return wrapper


LLMEngine.step = timed("step", LLMEngine.step)
ModelRunner.execute = timed("execute", ModelRunner.execute)
ModelRunner._prepare = timed("prepare", ModelRunner._prepare)
LlamaForCausalLM.forward = timed("forward", LlamaForCausalLM.forward)
LlamaForCausalLM.compute_logits = logits_wrapper(timed("logits", LlamaForCausalLM.compute_logits))
Sampler.__call__ = timed("sample", Sampler.__call__)
glib, clib = gguf_kernel.load(), cpu_ops.lib()
glib.kvp_gguf_matmul = timed("matmul_c", glib.kvp_gguf_matmul)
clib.kvp_rms_norm_f32 = timed("norm_act_c", clib.kvp_rms_norm_f32)
clib.kvp_silu_mul_f32 = timed("norm_act_c", clib.kvp_silu_mul_f32)
fused = cpu_decode._bind_fused(clib)
cpu_decode._bind_fused = lambda lib, f=timed("attn_c", fused): f
stack = llm.engine.runner.model.decode_stack
stack.fn = timed("stack_c", stack.fn)

# the cost of one timer: an empty function wrapped
probe = timed("probe", lambda: None)
t = time.perf_counter_ns()
for _ in range(10000):
    probe()
timer_ns = (time.perf_counter_ns() - t) / 10000
acc.clear(); calls.clear()


def run(n):
    acc.clear(); calls.clear()
    t = time.perf_counter_ns()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter_ns() - t, dict(acc), dict(calls)


result = {"cpu": detect_cpu().model_name, "loadavg_before": os.getloadavg(), "prompt_tokens": len(ids),
          "new_tokens": N, "timer_ns_per_call": timer_ns, "modes": {}}
for threads in (1, 2):
    torch.set_num_threads(threads)
    run(4)
    rounds = {"modules": [], "stack": []}
    for _ in range(ROUNDS):
        for mode in rounds:
            DecodeStack.enabled = mode == "stack"
            (w1, a1, c1), (w, a, c) = run(1), run(N)
            keys = ("step", "execute", "prepare", "forward", "logits", "lm_head_c", "sample", "matmul_c", "attn_c",
                    "norm_act_c", "stack_c")
            per = {k: (a.get(k, 0) - a1.get(k, 0)) / (N - 1) / 1e6 for k in keys}
            per_calls = {k: (c.get(k, 0) - c1.get(k, 0)) / (N - 1) for k in c}
            per["total"] = (w - w1) / (N - 1) / 1e6
            per["outside_step"] = per["total"] - per["step"]
            per["step_minus_execute"] = per["step"] - per["execute"]
            per["execute_minus_parts"] = per["execute"] - per["prepare"] - per["forward"] - per["logits"] - per["sample"]
            per["logits_minus_lm_head_c"] = per["logits"] - per["lm_head_c"]
            per["forward_python"] = per["forward"] - per["matmul_c"] - per["attn_c"] - per["norm_act_c"] - per["stack_c"]
            per["timer_overhead_ms"] = sum(per_calls.values()) * timer_ns / 1e6
            per["loadavg"] = os.getloadavg()[0]
            rounds[mode].append((per, per_calls))
    for mode, rs in rounds.items():
        med = {k: statistics.median(r[0][k] for r in rs) for k in rs[0][0]}
        result["modes"][f"{mode}, {threads} thread(s)"] = {"median_ms_per_token": med, "calls_per_token": rs[0][1],
                                                          "rounds": [r[0] for r in rs]}
        print(mode, threads, json.dumps({k: round(v, 3) for k, v in med.items()}), flush=True)
DecodeStack.enabled = True
result["loadavg_after"] = os.getloadavg()
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
