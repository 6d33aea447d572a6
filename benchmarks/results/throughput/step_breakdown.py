"""CPU-time breakdown of a steady fp32 decode step (1 thread): engine.step, of which
ModelRunner.execute (forward + sampling), of which the matmul floor (every linear layer
and the LM head run alone on the step's shapes), the rest per-op overhead. process_time
is used throughout, so the shared machine's load inflates it less than wall time."""
import json, os, sys, time, statistics, torch, torch.nn.functional as F
torch.set_num_threads(1)
from kvpilot.bench.decode_step import _engine, _fill
from kvpilot.bench.datasets import sharegpt_pairs
from kvpilot.engine.layers.linear import _Linear
out = {}
for batch in map(int, sys.argv[1].split(",")):
    llm = _engine("smollm2-135m-instruct", "float32", batch, 16, 30)
    tok = llm.get_tokenizer(); prompts = []
    for p, _ in sharegpt_pairs():
        ids = tok.encode(p, add_special_tokens=False)
        if len(ids) >= 16: prompts.append(ids[:16])
        if len(prompts) == batch: break
    _fill(llm, prompts, "p")
    runner = llm.engine.runner
    spent = {"execute": 0.0}
    orig = runner.execute
    def timed(*a, **k):
        c = time.process_time(); r = orig(*a, **k); spent["execute"] += time.process_time() - c; return r
    runner.execute = timed
    for _ in range(2): llm.engine.step()
    spent["execute"] = 0.0
    steps = 12
    c = time.process_time()
    for _ in range(steps): llm.engine.step()
    step_ms = (time.process_time() - c) / steps * 1e3
    exec_ms = spent["execute"] / steps * 1e3
    lins = [m for m in runner.model.modules() if isinstance(m, _Linear) and m is not runner.model.embed_tokens]
    xs = [torch.randn(batch, m.weight.shape[1]) for m in lins]
    head = runner.model.lm_head; hx = torch.randn(batch, head.weight.shape[1])
    with torch.inference_mode():
        samples = []
        for _ in range(5):
            c = time.process_time()
            for m, x in zip(lins, xs): m.matmul(x)
            head.matmul(hx)
            samples.append((time.process_time() - c) * 1e3)
    mm_ms = statistics.median(samples)
    out[str(batch)] = {"step_cpu_ms": step_ms, "execute_cpu_ms": exec_ms, "matmul_floor_cpu_ms": mm_ms,
                       "scheduler_detok_python_ms": step_ms - exec_ms, "forward_overhead_ms": exec_ms - mm_ms}
    print(batch, out[str(batch)], flush=True)
    del llm, runner
out["loadavg"] = os.getloadavg()
json.dump(out, open(sys.argv[2], "w"), indent=2)
