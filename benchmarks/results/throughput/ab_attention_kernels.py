"""Two builds of the CPU kernel library (e.g. main's and this branch's paged_decode_*.so from
~/.cache/kvpilot/kernels) in one float32 engine, alternated step by step; the decode
attention's CPU ms per step (`cpu_decode._run_rows`) and the step's. Mode 'unfused' runs
only kvp_paged_decode_f32 from each library (main's library has no fused functions).

usage: ab_attention_kernels.py A.so B.so BATCH PROMPT_LEN [MODE]
"""
import sys, time, ctypes, torch, collections
torch.set_num_threads(1)
from kvpilot.bench.decode_step import _engine, _fill, _sharegpt_prompts
from kvpilot.engine.attention import cpu_decode
libs = {"A": ctypes.CDLL(sys.argv[1]), "B": ctypes.CDLL(sys.argv[2])}
P, I = ctypes.c_void_p, ctypes.c_int64
for l in libs.values():
    l.kvp_paged_decode_f32.restype = ctypes.c_int
    l.kvp_paged_decode_f32.argtypes = [P, I, I, P, P, P, I, P, P, I, I, I, I, I, I, ctypes.c_float]
b = int(sys.argv[3]); plen = int(sys.argv[4])
llm = _engine("smollm2-135m-instruct", "float32", b, plen, 40)
from kvpilot.bench.decode_step import _set_cpu_kernel
_set_cpu_kernel(llm, sys.argv[5] if len(sys.argv) > 5 else "on")
_fill(llm, _sharegpt_prompts(llm.get_tokenizer(), b, plen), "x")
cur = ["A"]
cpu_decode.load = lambda: libs[cur[0]]
for x in "AB":
    cur[0] = x; llm.engine.step()
attn = collections.defaultdict(list); step = collections.defaultdict(list)
orig = cpu_decode._run_rows
acc = [0.0]
def timed(*a):
    c = time.process_time(); orig(*a); acc[0] += time.process_time() - c
cpu_decode._run_rows = timed
for i in range(24):
    x = "AB"[i % 2]; cur[0] = x; acc[0] = 0.0
    c = time.process_time(); llm.engine.step(); step[x].append((time.process_time() - c) * 1e3); attn[x].append(acc[0] * 1e3)
import statistics as st
print(f"batch {b} prompt {plen}:", {x: (round(st.median(step[x]), 1), round(st.median(attn[x]), 2)) for x in "AB"}, "(step ms, attention ms)")
