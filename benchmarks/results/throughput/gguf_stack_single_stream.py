"""One stream (and a batch of 4), side by side, interleaved (section 6c): kvpilot fp32 `--quantization
gguf` (q8_1 activations, the default) with the C decode stack on (`stack`: all layers of a decode step
in one C call, engine/layers/cpu_decode_stack.py) and off (`modules`: layer by layer, as before), one
engine toggled by DecodeStack.enabled, and llama.cpp (llama-cpp-python, a persistent subprocess of the interpreter given as
LLAMA_PY, -I so the repo's folders do not shadow stdlib modules) on the same GGUF, at 1 and 2
threads. Same prompt token ids everywhere (a ShareGPT chat prompt), greedy, 48 new tokens (EOS
ignored by us, never reached by llama.cpp's loop which stops at 48); decode ms per token =
(run(48) - run(1)) / 47 in each of 5 rounds, median (and min) over rounds, and the median
inter-token latency (ms between consecutive tokens of run(48), the engine stepped as LLM.generate
steps it), median over rounds. The batch of 4 (kvpilot only: 4 ShareGPT prompts decoding
together) gives ms per decode step the same way.
Usage: LLAMA_PY=/path/to/python python gguf_stack_single_stream.py OUT.json"""
import itertools, os, sys, time
import torch
import single_stream_common as common_
from kvpilot.bench.datasets import sharegpt_pairs
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.layers.cpu_decode_stack import DecodeStack

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

llama = common_.start(MODEL)


def run(name, threads, n, batch=1):
    """(wall s, cpu s, tokens of the first request, ms of each decode step) of `batch`
    requests of n new tokens, stepping the engine as LLM.generate does."""
    if name == "llama.cpp":
        return common_.run(llama, threads, n, ids)
    torch.set_num_threads(threads)
    DecodeStack.enabled = engines[name]
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    w, c = time.perf_counter(), time.process_time()
    rids = [f"r{next(counter)}" for _ in range(batch)]
    for rid, p in zip(rids, prompts[:batch]):
        engine.add_request(rid, p, params)
    stamps, first = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = out if out.request_id == rids[0] else first
        stamps.append(time.perf_counter())
    itl_ms = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return time.perf_counter() - w, time.process_time() - c, list(first.outputs[0].token_ids), itl_ms


counter = itertools.count()
names = [*engines, *(["llama.cpp"] if llama else [])]
loadavg_before = os.getloadavg()


def batch4(threads, res):  # 4 streams decoding together: ms per step
    for name in engines:
        res.setdefault(f"{name}, batch 4, {threads} thread(s)", []).append(
            common_.decode_ms(lambda *a: run(a[0], a[1], a[3], a[2]), N, name, threads, 4))


tokens, res = common_.interleaved(run, names, N, ROUNDS, batch4)
common_.report(sys.argv[1], tokens, res, "kvpilot gguf modules", loadavg_before, prompt_tokens=len(ids), new_tokens=N)
common_.stop(llama)
