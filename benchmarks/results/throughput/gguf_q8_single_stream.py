"""One stream, side by side, interleaved: kvpilot fp32 `--quantization gguf` with 8-bit activations
(q8_1, the default) vs float32 activations (KVPILOT_GGUF_ACTIVATIONS=float32), two engines in one
process, and llama.cpp (llama-cpp-python, a persistent subprocess of the interpreter given as
LLAMA_PY, -I so the repo's folders do not shadow stdlib modules) on the same GGUF, at 1 and 2
threads. Same prompt token ids everywhere (a ShareGPT chat prompt), greedy, 48 new tokens (EOS
ignored by us, never reached by llama.cpp's loop which stops at 48); decode ms per token =
(run(48) - run(1)) / 47 in each of 5 rounds, median (and min) over rounds.
Usage: LLAMA_PY=/path/to/python python gguf_q8_single_stream.py OUT.json"""
import os, sys, time
import torch
import single_stream_common as common_
from kvpilot.bench.datasets import sharegpt_pairs
from kvpilot.engine import LLM, SamplingParams

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

llama = common_.start(MODEL)


def run(name, threads, n):
    """(wall s, cpu s, tokens) of one request of n new tokens."""
    if name == "llama.cpp":
        return common_.run(llama, threads, n, ids)
    torch.set_num_threads(threads)
    w, c = time.perf_counter(), time.process_time()
    out = engines[name].generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - w, time.process_time() - c, list(out[0].outputs[0].token_ids)


names = [*engines, *(["llama.cpp"] if llama else [])]
loadavg_before = os.getloadavg()
tokens, res = common_.interleaved(run, names, N, ROUNDS)
common_.report(sys.argv[1], tokens, res, "kvpilot gguf float32", loadavg_before, prompt_tokens=len(ids), new_tokens=N)
common_.stop(llama)
