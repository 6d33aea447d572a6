"""`kvpilot bench sampling-params`: what the logits-changing sampling parameters cost. Output
tokens/s of the same ShareGPT chat requests, all running at once (--num-prompts of them in the
engine's steps, 64 by default), with no such parameter and with each of: presence + frequency
penalties, a repetition penalty, a logit_bias of --bias-tokens tokens, --bad-words bad words,
and all of them together, on every request. One engine (`LLM`, the step path `kvpilot serve`
runs) after a warm-up, the modes taking turns --repeats times (best of each kept); greedy with
`ignore_eos`, so every request makes exactly --max-tokens tokens whatever the parameters do to
the text. Figures: benchmarks/results/sampling_params/README.md."""

from __future__ import annotations

import argparse
import time

from kvpilot.bench.report import write_result
from kvpilot.engine.settings import BY_NAME
from kvpilot.loadgen.datasets import sample_sharegpt_requests
from kvpilot.loadgen.machine import loadavg, machine_info

BAD_WORDS = ["however", "therefore", "basically", "actually", "literally", "obviously", "simply", "really"]


def modes(bias_tokens: int, bad_words: int) -> dict[str, dict]:
    """Mode name -> the SamplingParams fields it sets on every request."""
    bias = {1000 + 37 * i: (-5.0 if i % 2 else 5.0) for i in range(bias_tokens)}
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.5}
    words = {"bad_words": BAD_WORDS[:bad_words]}
    return {"none": {}, "presence+frequency": penalties, "repetition": {"repetition_penalty": 1.2},
            "logit_bias": {"logit_bias": bias}, "bad_words": words,
            "all": {**penalties, "repetition_penalty": 1.2, "logit_bias": bias, **words}}


def run_once(llm, prompts: list[list[int]], max_tokens: int, fields: dict) -> dict:
    """One pass over prompts with `fields` on every request; seconds and output tokens/s."""
    from kvpilot.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields) for _ in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot bench sampling-params", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=64, help="requests, all running at once")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--bias-tokens", type=int, default=20, help="logit_bias entries per request")
    p.add_argument("--bad-words", type=int, default=4, choices=range(len(BAD_WORDS) + 1), metavar="N")
    p.add_argument("--seed", type=int, default=0, help="the ShareGPT sample's seed")
    p.add_argument("--repeats", type=int, default=3, help="passes per mode, taking turns; the best is kept")
    p.add_argument(BY_NAME["dtype"].flag, default="auto")
    p.add_argument(BY_NAME["quantization"].flag, choices=["gguf", "none"], default=None)
    p.add_argument("--output-json", default="benchmarks/results/sampling_params/sampling_params.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """`kvpilot bench sampling-params`: runs every mode (no logits parameter, each one, all)
    --repeats times on one engine, keeps each mode's best output tok/s, prints the table and writes
    it to --output-json with the machine block (kvpilot.loadgen.machine). Returns 0."""
    args = _parser().parse_args(argv)
    from kvpilot.engine import LLM

    load_before = loadavg()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=2048,
              max_num_seqs=max(args.num_prompts, 1))
    requests = sample_sharegpt_requests(llm.get_tokenizer(), args.num_prompts, seed=args.seed)
    prompts = [llm.apply_chat_template([{"role": "user", "content": r.prompt}]) for r in requests]
    table = modes(args.bias_tokens, args.bad_words)
    run_once(llm, prompts, 4, table["all"])  # warm-up: kernels, allocations, the count slots
    runs: dict[str, list[dict]] = {mode: [] for mode in table}
    for _ in range(args.repeats):
        for mode, fields in table.items():
            runs[mode].append(run_once(llm, prompts, args.max_tokens, fields))
    best = {mode: max(r, key=lambda x: x["output_tokens_per_s"]) for mode, r in runs.items()}
    base = best["none"]["output_tokens_per_s"]
    results = {"dtype": str(llm.engine.config.model.dtype).removeprefix("torch."),
               "quantization": llm.engine.config.quantization, "num_prompts": len(prompts),
               "prompt_tokens": sum(map(len, prompts)), "max_tokens": args.max_tokens, "modes": table, **best,
               "all_runs": runs, "over_none": {m: best[m]["output_tokens_per_s"] / base for m in table},
               "machine": machine_info(loadavg_before=load_before),
               "command": "kvpilot bench sampling-params " + " ".join(argv or [])}
    _print(results)
    write_result(args.output_json, results)
    return 0


def _print(r: dict) -> None:
    m = r["machine"]
    print(f"{m['cpu']} ({m['cores']} CPUs), {r['dtype']}, quantization {r['quantization']}: {r['num_prompts']} "
          f"ShareGPT chats at once, {r['max_tokens']} output tokens each; load before {m['loadavg_before']}")
    print(f"{'mode':20} {'seconds':>8} {'out tok':>8} {'out tok/s':>10} {'vs none':>8}")
    for name in r["modes"]:
        x = r[name]
        print(f"{name:20} {x['seconds']:8.1f} {x['output_tokens']:8d} {x['output_tokens_per_s']:10.1f} "
              f"{r['over_none'][name]:8.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
