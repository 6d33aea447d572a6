"""`kvpilot bench structured-outputs`: what a grammar costs. Output tokens/s of the same ShareGPT
chat requests without a grammar, with a JSON schema (vLLM's default: any whitespace between
tokens) and with the same schema as compact JSON (`disable_any_whitespace`), in one run of one
engine after a warm-up, the modes taking turns --repeats times (best of each kept); greedy with
`ignore_eos`, so every request makes exactly --max-tokens tokens each time (once a grammar is
complete its rows allow only the stop token). Also the time to compile grammars with xgrammar:
building the tokenizer's vocabulary table, then each grammar cold (first compile) and cached.
Figures: benchmarks/results/structured_outputs/README.md."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvpilot.bench.report import write_result
from kvpilot.engine.settings import BY_NAME
from kvpilot.loadgen.datasets import sample_sharegpt_requests
from kvpilot.loadgen.machine import loadavg, machine_info

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "summary": {"type": "string"},
    "topics": {"type": "array", "items": {"type": "string"}},
    "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]}},
    "required": ["title", "summary", "topics", "sentiment"]}
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean", "null"]}
                                         for i in range(40)}, "required": [f"field_{i}" for i in range(40)]}
GRAMMARS = {"json_schema (4 fields)": {"json": SCHEMA}, "json_schema (40 fields)": {"json": WIDE},
            "json_object": {"json_object": True}, "regex (date)": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
            "choice (3)": {"choice": ["positive", "neutral", "negative"]}}


def time_compiles(tokenizer, vocab_size: int, repeats: int = 50) -> dict:
    """Seconds to build the compiler (TokenizerInfo) and to compile each of GRAMMARS cold and
    cached (median of `repeats`), on a fresh compiler whose cache is empty."""
    from kvpilot.engine.structured_output.backend_xgrammar import GrammarCompiler
    from kvpilot.engine.structured_output.params import StructuredOutputsParams

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size)
    out = {"tokenizer_info_s": time.perf_counter() - t0, "grammars": {}}
    for name, spec in GRAMMARS.items():
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(**spec))
        cold = time.perf_counter() - t0
        cached = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiler.compile(StructuredOutputsParams(**spec))
            cached.append(time.perf_counter() - t0)
        out["grammars"][name] = {"cold_ms": cold * 1e3, "cached_ms": statistics.median(cached) * 1e3}
    return out


MODES = {"without_schema": None, "json_schema": False, "json_schema_compact": True}  # -> disable_any_whitespace


def run_once(llm, prompts: list[list[int]], max_tokens: int, compact: bool | None) -> dict:
    """One pass over prompts; compact None: no grammar, else SCHEMA with disable_any_whitespace=compact."""
    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.structured_output.params import StructuredOutputsParams

    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=None
                             if compact is None else StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=compact))
              for _ in prompts]
    grammar_s = _time_grammar_calls(llm.engine.runner.sampler) if compact is not None else {"s": 0.0, "calls": 0}
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    eos = llm.engine.config.model.eos_token_ids
    in_grammar = [next((i for i, t in enumerate(o.outputs[0].token_ids) if t in eos), max_tokens) for o in outs]
    valid = sum(_valid_json(llm.engine.tokenizer.decode(o.outputs[0].token_ids[:n])) for o, n in zip(outs, in_grammar))
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "grammar_s": grammar_s["s"], "grammar_ms_per_step": grammar_s["s"] * 1e3 / max(grammar_s["calls"], 1),
            "mean_tokens_before_stop": statistics.mean(in_grammar), "valid_json": valid}


def _time_grammar_calls(sampler) -> dict:
    """Wraps the sampler's GrammarBitmasks (mask: the batched fill and apply; accept) with a
    timer; returns the running totals {"s": seconds, "calls": steps}."""
    grammars, totals = sampler.grammars, {"s": 0.0, "calls": 0}
    for name in ("mask", "accept") if grammars is not None else ():  # None before the first grammar (warm-up)
        method = getattr(type(grammars), name)

        def timed(*args, _method=method, _name=name):
            t0 = time.perf_counter()
            try:
                return _method(grammars, *args)
            finally:
                totals["s"] += time.perf_counter() - t0
                totals["calls"] += _name == "mask"

        setattr(grammars, name, timed)
    return totals


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot bench structured-outputs", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="the ShareGPT sample's seed")
    p.add_argument("--repeats", type=int, default=3, help="passes per mode, taking turns; the best is kept")
    p.add_argument(BY_NAME["dtype"].flag, default="auto")
    p.add_argument(BY_NAME["quantization"].flag, choices=["gguf", "none"], default=None)
    p.add_argument("--output-json", default="benchmarks/results/structured_outputs/structured_outputs.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """`kvpilot bench structured-outputs`: times xgrammar's compiles, then runs every mode
    (without a schema, the schema, the compact schema) --repeats times on one engine, keeps each
    mode's best output tok/s, prints the table and writes it to --output-json with the machine
    block (kvpilot.loadgen.machine). Returns 0."""
    args = _parser().parse_args(argv)
    from kvpilot.engine import LLM

    load_before = loadavg()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=2048)
    tokenizer = llm.get_tokenizer()
    requests = sample_sharegpt_requests(tokenizer, args.num_prompts, seed=args.seed)
    prompts = [llm.apply_chat_template([{"role": "user", "content": r.prompt}]) for r in requests]
    compiles = time_compiles(tokenizer, llm.engine.config.model.vocab_size)
    run_once(llm, prompts, 8, True)  # warm-up: kernels, allocations, the grammar compiled
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, compact in MODES.items():
            runs[mode].append(run_once(llm, prompts, args.max_tokens, compact))
    best = {mode: max(r, key=lambda x: x["output_tokens_per_s"]) for mode, r in runs.items()}
    free = best["without_schema"]
    results = {"dtype": str(llm.engine.config.model.dtype).removeprefix("torch."),
               "quantization": llm.engine.config.quantization, "num_prompts": len(prompts),
               "prompt_tokens": sum(map(len, prompts)), "max_tokens": args.max_tokens, **best, "all_runs": runs,
               "over_without_schema": {m: best[m]["output_tokens_per_s"] / free["output_tokens_per_s"] for m in MODES},
               "compile": compiles, "machine": machine_info(loadavg_before=load_before),
               "command": "kvpilot bench structured-outputs " + " ".join(argv or [])}
    _print(results)
    write_result(args.output_json, results)
    return 0


def _print(r: dict) -> None:
    print(f"{r['machine']['cpu']}, {r['dtype']}, quantization {r['quantization']}: {r['num_prompts']} ShareGPT chats, "
          f"{r['max_tokens']} output tokens each")
    print(f"{'mode':20} {'seconds':>8} {'out tok':>8} {'out tok/s':>10} {'vs none':>8} {'grammar ms/step':>15} "
          f"{'grammar s':>9} {'tokens before stop':>19} {'valid JSON':>10}")
    for name in MODES:
        x = r[name]
        print(f"{name:20} {x['seconds']:8.1f} {x['output_tokens']:8d} {x['output_tokens_per_s']:10.1f} "
              f"{r['over_without_schema'][name]:8.3f} {x['grammar_ms_per_step']:15.2f} {x['grammar_s']:9.2f} "
              f"{x['mean_tokens_before_stop']:19.1f} {x['valid_json']:>10}")
    print(f"xgrammar TokenizerInfo: {r['compile']['tokenizer_info_s'] * 1e3:.0f} ms")
    print(f"{'grammar':26} {'cold ms':>9} {'cached ms':>10}")
    for name, x in r["compile"]["grammars"].items():
        print(f"{name:26} {x['cold_ms']:9.2f} {x['cached_ms']:10.4f}")


if __name__ == "__main__":
    raise SystemExit(main())
