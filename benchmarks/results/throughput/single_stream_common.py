"""Shared by the one-stream comparisons (gguf_q8_single_stream.py, gguf_stack_single_stream.py):
decode ms per token from two runs, the summary over rounds, and llama.cpp (llama-cpp-python)
as a persistent subprocess: the interpreter given as LLAMA_PY
runs with -I so the repo's folders do not shadow stdlib modules, loads the GGUF once per
thread count (1 and 2), and answers one JSON line per request: (wall s, cpu s, tokens) of a
greedy generation of n tokens from the given token ids, plus the ms between consecutive
tokens (inter-token latencies, the first token's prefill excluded)."""
import json, os, statistics, subprocess

from kvpilot.engine.cpu_info import detect_cpu

from kvpilot.engine.model_loader import builtin_gguf_path

LLAMA = r"""
import json, sys, time
from llama_cpp import Llama
llms = {t: Llama(model_path=sys.argv[1], n_ctx=1024, n_threads=t, n_batch=512, verbose=False) for t in (1, 2)}
for line in sys.stdin:
    threads, n, ids = json.loads(line)
    w, c = time.perf_counter(), time.process_time()
    out, stamps = [], []
    for t in llms[threads].generate(ids, top_k=1, temp=0.0, reset=True):
        out.append(t)
        stamps.append(time.perf_counter())
        if len(out) == n:
            break
    itl_ms = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    print(json.dumps([time.perf_counter() - w, time.process_time() - c, out, itl_ms]), flush=True)
"""


def start(model: str) -> subprocess.Popen | None:
    """The subprocess for `model`'s GGUF, or None when LLAMA_PY is unset."""
    if not os.environ.get("LLAMA_PY"):
        return None
    return subprocess.Popen([os.environ["LLAMA_PY"], "-I", "-c", LLAMA, str(builtin_gguf_path(model))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")


def run(llama: subprocess.Popen, threads: int, n: int, ids: list[int]) -> tuple:
    """(wall s, cpu s, tokens, inter-token ms) of one greedy request of n new tokens."""
    llama.stdin.write(json.dumps([threads, n, ids]) + "\n")
    llama.stdin.flush()
    return tuple(json.loads(llama.stdout.readline()))


def stop(llama: subprocess.Popen | None) -> None:
    if llama:
        llama.stdin.close()
        llama.wait()


def decode_ms(run, n: int, *args) -> dict:
    """ms per decoded token (per step for a batch) from run(*args, 1) and run(*args, n), each
    returning (wall s, cpu s, ...): (run(n) - run(1)) / (n - 1), with the load average; and
    the median inter-token ms of run(n) where run returns them fourth (robust to a run(1)
    slowed by another process, which can make the difference meaningless on a busy machine)."""
    (w1, c1, *_), (w, c, *rest) = run(*args, 1), run(*args, n)
    out = {"wall_ms_per_token": (w - w1) / (n - 1) * 1e3, "cpu_ms_per_token": (c - c1) / (n - 1) * 1e3,
           "loadavg": os.getloadavg()[0]}
    if len(rest) > 1:
        out["median_itl_ms"] = statistics.median(rest[1])
    return out


def summarize(res: dict[str, list[dict]]) -> dict:
    """Median (and min) wall and median cpu ms per token over the rounds of each entry, and the
    median over rounds of the median inter-token ms where measured."""
    out = {k: {"median_wall_ms_per_token": statistics.median(r["wall_ms_per_token"] for r in v),
               "min_wall_ms_per_token": min(r["wall_ms_per_token"] for r in v),
               "median_cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in v)} for k, v in res.items()}
    for k, v in res.items():
        if all("median_itl_ms" in r for r in v):
            out[k]["median_itl_ms"] = statistics.median(r["median_itl_ms"] for r in v)
    return out


def interleaved(run, names: list[str], n: int, rounds: int, extra=None) -> tuple[dict, dict]:
    """Greedy tokens of each name at 1 thread, then `rounds` rounds of decode_ms for every name
    at 1 and 2 threads, interleaved; extra(threads, res), when given, adds entries after each.
    run(name, threads, n) -> (wall s, cpu s, tokens). Returns (tokens by name, res)."""
    tokens = {name: run(name, 1, n)[2] for name in names}
    res: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for threads in (1, 2):
            for name in names:
                run(name, threads, 2)
                res.setdefault(f"{name}, {threads} thread(s)", []).append(decode_ms(run, n, name, threads))
                print(name, threads, res[f"{name}, {threads} thread(s)"][-1], flush=True)
            if extra:
                extra(threads, res)
    return tokens, res


def first_diff(tokens: dict[str, list[int]], reference: str) -> dict[str, int | None]:
    """Index of each name's first token unequal to the reference's, None where all are equal."""
    return {name: next((i for i, (a, b) in enumerate(zip(tokens[reference], t)) if a != b), None)
            for name, t in tokens.items()}


def report(path: str, tokens: dict, res: dict, reference: str, loadavg_before, **fields) -> None:
    """Writes the JSON (CPU, load averages, summary, rounds, first differing tokens against
    `reference`) and prints the summary."""
    summary, diff = summarize(res), first_diff(tokens, reference)
    with open(path, "w") as f:
        json.dump({"cpu": detect_cpu().model_name, **fields, f"first_token_differing_from_{reference}": diff,
                   "loadavg_before": loadavg_before, "loadavg_after": os.getloadavg(), "summary": summary,
                   "rounds": res}, f, indent=2)
    print(json.dumps(summary, indent=1), f"first differing token vs {reference}:", diff)
