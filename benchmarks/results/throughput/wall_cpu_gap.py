"""wall/CPU of kvpilot fp32 vs HF generate fp32, one stream, interleaved, with context switches."""
import os, time, resource, torch, json
torch.set_num_threads(1)
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model_loader import resolve_model_path
from transformers import AutoModelForCausalLM
N = 32
path = resolve_model_path("smollm2-135m-instruct")
llm = LLM(str(path), dtype="float32", max_model_len=1024, max_num_seqs=4, num_gpu_blocks_override=128, swap_space=0)
ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Explain paged attention briefly."}], add_generation_prompt=True, tokenize=True)
ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
def ours(n): llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
def theirs(n):
    with torch.inference_mode(): hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
runs = {"kvpilot": ours, "hf": theirs}
for f in runs.values(): f(2)
for r in range(3):
    for k, f in runs.items():
        u0 = resource.getrusage(resource.RUSAGE_SELF); w, c = time.perf_counter(), time.process_time()
        f(N)
        w, c = time.perf_counter() - w, time.process_time() - c; u1 = resource.getrusage(resource.RUSAGE_SELF)
        print(f"{k:8s} round {r}: wall {w*1e3/N:6.1f} ms/tok cpu {c*1e3/N:6.1f} ms/tok ratio {w/c:4.2f} "
              f"vol_cs {u1.ru_nvcsw-u0.ru_nvcsw} invol_cs {u1.ru_nivcsw-u0.ru_nivcsw} minflt {u1.ru_minflt-u0.ru_minflt}", flush=True)
print(os.getloadavg())
