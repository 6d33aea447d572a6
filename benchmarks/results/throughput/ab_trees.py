"""Decode-step CPU and wall time of two source trees (e.g. main before the fusion and this
branch), interleaved round by round: one worker process per tree (PYTHONPATH given per
tree), each holding a float32 engine with `batch` ShareGPT requests past prefill; the
driver alternates them, `steps` steps per round, so the machine's load falls on both alike.

usage: ab_trees.py NAME=PYTHONPATH NAME=PYTHONPATH BATCHES OUT.json [PROMPT_LEN] [ROUNDS] [STEPS]
"""
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import sys, time, json, torch
torch.set_num_threads(1)
from kvpilot.bench.decode_step import _engine, _fill, _drain, _sharegpt_prompts
batches, prompt_len, total = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = _engine("smollm2-135m-instruct", "float32", max(batches), prompt_len, total)
prompts = _sharegpt_prompts(llm.get_tokenizer(), max(batches), prompt_len)
print("ready", flush=True)
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "fill":
        _fill(llm, prompts[:int(arg)], "b" + arg); llm.engine.step(); llm.engine.step(); print("ok", flush=True)
    elif cmd == "drain":
        _drain(llm, int(arg), "b" + arg); print("ok", flush=True)
    else:
        cpu, wall = [], []
        for _ in range(int(arg)):
            w, c = time.perf_counter(), time.process_time(); llm.engine.step()
            wall.append(1e3 * (time.perf_counter() - w)); cpu.append(1e3 * (time.process_time() - c))
        print(json.dumps([cpu, wall]), flush=True)
"""


def main() -> None:
    trees = dict(a.split("=", 1) for a in sys.argv[1:3])
    batches = [int(b) for b in sys.argv[3].split(",")]
    prompt_len = int(sys.argv[5]) if len(sys.argv) > 5 else 128
    rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 5
    steps = int(sys.argv[7]) if len(sys.argv) > 7 else 4
    procs = {}
    for name, path in trees.items():
        env = {**os.environ, "PYTHONPATH": path}
        procs[name] = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(batches), str(prompt_len),
                                        str(rounds * steps + 8)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=env)
        while procs[name].stdout.readline().strip() != "ready":
            pass

    def ask(p, cmd):
        p.stdin.write(cmd + "\n")
        p.stdin.flush()
        return p.stdout.readline()

    out = {"loadavg_before": os.getloadavg(), "trees": trees, "prompt_len": prompt_len, "rounds": rounds,
           "steps": steps, "torch_threads": 1, "results": {}}
    for batch in batches:
        for p in procs.values():
            ask(p, f"fill {batch}")
        samples = {n: ([], []) for n in procs}
        for _ in range(rounds):
            for n, p in procs.items():
                cpu, wall = json.loads(ask(p, f"steps {steps}"))
                samples[n][0].extend(cpu)
                samples[n][1].extend(wall)
        out["results"][str(batch)] = {n: {"step_cpu_ms": statistics.median(c), "step_wall_ms": statistics.median(w),
                                          "cpu_ms_all": c} for n, (c, w) in samples.items()}
        print(batch, {n: (round(statistics.median(c), 1), round(statistics.median(w), 1))
                      for n, (c, w) in samples.items()}, flush=True)
        for p in procs.values():
            ask(p, f"drain {batch}")
    for p in procs.values():
        p.stdin.close()
        p.wait(timeout=60)
    out["loadavg_after"] = os.getloadavg()
    with open(sys.argv[4], "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
