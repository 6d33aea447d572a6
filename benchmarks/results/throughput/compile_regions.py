"""torch.compile (Inductor, CPU) of the decoder layer's two regions around the paged
attention, as vLLM compiles piecewise with attention as the splitting op: (add + RMSNorm +
qkv projection + RoPE) and (o_proj + add + RMSNorm + gate/up + SiLU-and-mul + down), one
static-shape graph per batch size (the "bucket"), weights passed as inputs so the 30 layers
share it. Measured against the C-kernel engine ('on') and the previous eager path
('unfused'), one process, interleaved; also the compile time per bucket (CPU and wall s).
A measurement for the README, not an engine mode.

usage: compile_regions.py BATCHES OUT.json [PROMPT_LEN] [ROUNDS] [STEPS]
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
from kvpilot.bench.decode_step import _drain, _engine, _fill, _set_cpu_kernel, _sharegpt_prompts  # noqa: E402
from kvpilot.engine.layers.rotary_embedding import apply_rotary  # noqa: E402
from kvpilot.engine.models.llama import LlamaDecoderLayer  # noqa: E402

H, EPS = 576, 1e-5


def pre(x, residual, norm_w, qkv_w, cos, sin, nh: int, nkv: int, hd: int):
    residual = x + residual
    h = F.rms_norm(residual, (H,), norm_w, EPS)
    qkv = F.linear(h, qkv_w).view(x.shape[0], -1, hd)
    qk = apply_rotary(qkv[:, : nh + nkv], (cos, sin))
    return qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:], residual


def post(o, o_w, residual, norm_w, gate_up_w, down_w):
    residual = F.linear(o, o_w) + residual
    h = F.rms_norm(residual, (H,), norm_w, EPS)
    g, u = F.linear(h, gate_up_w).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down_w), residual


cpre, cpost = torch.compile(pre, dynamic=False), torch.compile(post, dynamic=False)


def compiled_layer(self, rope, x, residual, kv_cache, meta):
    a = self.self_attn
    if residual is None:
        residual = torch.zeros_like(x)
    q, k, v, residual = cpre(x, residual, self.input_layernorm.weight, a.qkv_proj.weight, rope[0], rope[1],
                             a.num_heads, a.num_kv_heads, a.head_dim)
    o = a.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, a.scale)
    return cpost(o.reshape(x.shape[0], -1), a.o_proj.weight, residual, self.post_attention_layernorm.weight,
                 self.mlp.gate_up_proj.weight, self.mlp.down_proj.weight)


batches = [int(b) for b in sys.argv[1].split(",")]
prompt_len = int(sys.argv[3]) if len(sys.argv) > 3 else 128
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
steps = int(sys.argv[5]) if len(sys.argv) > 5 else 4
engines = {m: _engine("smollm2-135m-instruct", "float32", max(batches), prompt_len, rounds * steps + 8)
           for m in ("on", "unfused", "compiled")}
_set_cpu_kernel(engines["on"], "on")
_set_cpu_kernel(engines["unfused"], "unfused")
_set_cpu_kernel(engines["compiled"], "unfused")  # attention: the C decode kernel, RoPE/write outside
eager_forward = LlamaDecoderLayer.forward
prompts = _sharegpt_prompts(engines["on"].get_tokenizer(), max(batches), prompt_len)
out = {"loadavg_before": os.getloadavg(), "torch": torch.__version__, "results": {}}
for batch in batches:
    for m, llm in engines.items():
        _fill(llm, prompts[:batch], f"b{batch}")
    LlamaDecoderLayer.forward = compiled_layer
    w, c = time.perf_counter(), time.process_time()
    engines["compiled"].engine.step()  # compiles this batch size's graphs
    compile_wall, compile_cpu = time.perf_counter() - w, time.process_time() - c
    LlamaDecoderLayer.forward = eager_forward
    cpu = {m: [] for m in engines}
    for _ in range(rounds):
        for m, llm in engines.items():
            LlamaDecoderLayer.forward = compiled_layer if m == "compiled" else eager_forward
            for _ in range(steps):
                c = time.process_time()
                llm.engine.step()
                cpu[m].append(1e3 * (time.process_time() - c))
    LlamaDecoderLayer.forward = eager_forward
    row = {"compile_wall_s": compile_wall, "compile_cpu_s": compile_cpu,
           **{m: statistics.median(v) for m, v in cpu.items()}}
    out["results"][str(batch)] = row
    print(batch, {k: round(v, 2) for k, v in row.items()}, flush=True)
    for m, llm in engines.items():
        _drain(llm, batch, f"b{batch}")
out["loadavg_after"] = os.getloadavg()
with open(sys.argv[2], "w") as f:
    json.dump(out, f, indent=2)
