"""`kvpilot bench throughput`: offline throughput of our engine against Hugging Face
`generate()` on the same ShareGPT requests, in one run.

Requests: vLLM's ShareGPT filter and reference output lengths, generated with
`ignore_eos` so both sides produce exactly the requested tokens (vLLM's
`benchmark_throughput`). Hugging Face runs static batches (default 16, left padded): each
batch decodes until its longest request is done, and only the requested tokens count.
Also reported: the CPU (model, ISA flags) and the dtype (`--dtype auto`: the engine's rule for
this CPU, with its reason), the matmul peak of that dtype at M=256 measured in the same run
through the engine's linear path, the fraction of it our total tokens/s reaches (2 x
parameters x tokens / time / peak), single-request decode tokens/s for both, and where the
engine's time goes (torch profiler, by operator). Our engine runs as it ships: on a GGUF model
(the builtin SmolLM2) on CPU that is `--quantization gguf` (vLLM's default for a GGUF file):
decode-sized matmuls read the GGUF's Q4_1/Q8_0 blocks (3.4x fewer weight bytes than bf16, 6.4x
fewer than float32) with 8-bit activations, larger ones the dense weights HF loads (dequantized
from that GGUF); `--quantization none` keeps our engine on the dense weights as well.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from kvpilot.bench.report import write_result
from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.settings import BY_NAME
from kvpilot.loadgen.datasets import SampleRequest, sample_sharegpt_requests
from kvpilot.loadgen.machine import loadavg, machine_info


def measure_matmul_peak_gflops(dtype: torch.dtype = torch.bfloat16, m: int = 256, size: int = 2048,
                               repeats: int = 5, min_time_s: float = 1.0) -> float:
    """Best GFLOP/s of an [m, size] x [size, size]^T matmul in `dtype` on this CPU over at least
    `repeats` timed calls and `min_time_s` seconds, through the engine's own linear path
    (layers/linear.py: oneDNN-prepacked weights, F.linear where packing is unavailable), so the
    peak is the one the engine can reach; a plain torch bf16 matmul on a CPU without native bf16
    is a slow fallback it never runs. The time floor keeps a VM's short stall from reading as the
    peak: five calls (~85 ms in float32 on a 2-core AVX2 EPYC) once measured 70 GFLOP/s where the
    run before measured 126."""
    from kvpilot.engine.layers.linear import RowParallelLinear, pack_weights_for_cpu

    layer = RowParallelLinear(size, size, dtype)
    layer.weight.data.copy_(torch.randn(size, size) / size**0.5)
    pack_weights_for_cpu(layer)
    x = torch.randn(m, size, dtype=dtype)
    with torch.inference_mode():
        layer.matmul(x)
        best, calls, start = float("inf"), 0, time.perf_counter()
        while calls < repeats or time.perf_counter() - start < min_time_s:
            t = time.perf_counter()
            layer.matmul(x)
            best = min(best, time.perf_counter() - t)
            calls += 1
    return 2 * m * size * size / best / 1e9


def run_ours(llm, requests: list[SampleRequest]) -> float:
    """Seconds `llm` (our LLM) takes for every request at once, greedy with ignore_eos. Raises
    RuntimeError when the output tokens differ from the requests' expected_output_len sum."""
    from kvpilot.engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.expected_output_len, ignore_eos=True) for r in requests]
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    want = sum(r.expected_output_len for r in requests)
    if got != want:
        raise RuntimeError(f"engine produced {got} output tokens, expected {want}")
    return elapsed


def run_hf(model, tokenizer, requests: list[SampleRequest], batch_size: int) -> float:
    """Seconds HF `model.generate()` takes over `requests` in static left-padded greedy batches of
    `batch_size`, each exactly its longest request's tokens (pad token: EOS where it has none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            enc = tokenizer([r.prompt for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
            longest = max(r.expected_output_len for r in batch)
            model.generate(**enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    return time.perf_counter() - t


def single_request_tok_s(fn, num_tokens: int) -> float:
    """`num_tokens` over the wall seconds `fn()` takes: one request's decode rate (tokens/s)."""
    t = time.perf_counter()
    fn()
    return num_tokens / (time.perf_counter() - t)


# Operator groups of `profile_engine` by event-name prefix; kvpilot::* are the C kernels' ranges
# (kvpilot.kernels.cpu.loader.kernel_range), which the torch profiler cannot see otherwise.
PROFILE_GROUPS = {
    "decode stack (all layers in one C call)": ("kvpilot::decode_stack",),
    "matmul (linear layers, LM head)": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
                                        "mkldnn::_linear_pointwise", "kvpilot::gguf_matmul", "kvpilot::bf16_matmul"),
    "attention (SDPA, C kernels)": ("aten::_scaled_dot_product", "aten::scaled_dot_product",
                                    "kvpilot::attention"),
    "KV gather/scatter (paged cache)": ("aten::index", "aten::index_copy_", "aten::index_select",
                                        "aten::masked_fill"),
    "elementwise (norm, RoPE, SiLU, residual)": ("aten::mul", "aten::add", "aten::cat", "aten::silu",
                                                 "aten::rsqrt", "aten::mean", "aten::pow", "aten::neg", "aten::sub",
                                                 "kvpilot::rms_norm", "kvpilot::silu_mul", "kvpilot::rope_cache_write"),
    "copies and dtype casts": ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone"),
    "sampling": ("aten::argmax", "aten::softmax", "aten::log_softmax", "aten::topk", "aten::sort",
                 "aten::uniform_", "aten::log_", "kvpilot::sample_rows"),
}


def profile_group(key: str) -> str | None:
    """The PROFILE_GROUPS group of a profiler event name, None for the rest."""
    for group, prefixes in PROFILE_GROUPS.items():
        if key.startswith(prefixes):
            return group
    return None


def profile_engine(llm, requests: list[SampleRequest], steps: int = 20) -> list[tuple[str, float]]:
    """Share of engine step time by operator group over `steps` steps of a full batch."""
    from kvpilot.engine import SamplingParams

    engine = llm.engine
    for i, r in enumerate(requests):
        engine.add_request(f"profile-{i}", r.prompt, SamplingParams(max_tokens=r.expected_output_len, ignore_eos=True))
    sched = engine.scheduler
    for _ in range(1000):  # past the prefills, into steady decode
        if not sched.waiting and not any(seq.is_prefill for seq in sched.running):
            break
        engine.step()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall_us = (time.perf_counter() - t0) * 1e6
    for i in range(len(requests)):
        engine.abort_request(f"profile-{i}")
    totals = dict.fromkeys(PROFILE_GROUPS, 0.0)
    for evt in prof.key_averages():
        group = profile_group(evt.key)
        if group is not None:
            totals[group] += evt.self_cpu_time_total
    rows = [(g, t / wall_us) for g, t in totals.items()]
    rows.append(("python, scheduling and other", max(0.0, 1 - sum(t for _, t in rows))))
    return rows


def _time_ours(llm, requests: list, max_num_seqs: int) -> tuple[float, float, list[tuple[str, float]]]:
    """Our engine after a warm-up: (seconds for all requests, single-request decode tokens/s
    over 128 tokens, profile_engine's shares for a batch of up to max_num_seqs)."""
    from kvpilot.engine import SamplingParams

    llm.generate(requests[0].prompt, SamplingParams(max_tokens=8))  # warm-up
    ours_s = run_ours(llm, requests)
    single_ours = single_request_tok_s(
        lambda: llm.generate(requests[0].prompt, SamplingParams(max_tokens=128, ignore_eos=True)), 128)
    return ours_s, single_ours, profile_engine(llm, requests[: min(len(requests), max_num_seqs)])


def _summary(elapsed: float, run: dict) -> dict:
    """Rates of one engine over the run's requests (`run`: num_prompts, prompt_tokens,
    output_tokens, num_params, matmul_peak_gflops) that took `elapsed` seconds."""
    prompt_tokens, output_tokens, num_params = run["prompt_tokens"], run["output_tokens"], run["num_params"]
    return {"elapsed_s": elapsed, "requests_per_s": run["num_prompts"] / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "fraction_of_peak": 2 * num_params * (prompt_tokens + output_tokens) / elapsed
            / (run["matmul_peak_gflops"] * 1e9)}


def _time_hf(model_name: str, dtype: torch.dtype, tokenizer, requests: list, batch_size: int) -> tuple[float, float]:
    """The baseline: HF transformers generate() on the same requests. Returns (seconds for all,
    single-request decode tokens/s over 128 tokens)."""
    from transformers import AutoModelForCausalLM

    from kvpilot.engine.model_loader import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(model_name)), dtype=dtype).eval()
    hf_s = run_hf(model, tokenizer, requests, batch_size)
    enc = tokenizer(requests[0].prompt, return_tensors="pt", add_special_tokens=False)
    single_hf = single_request_tok_s(lambda: model.generate(
        **enc, max_new_tokens=128, min_new_tokens=128, do_sample=False, pad_token_id=tokenizer.eos_token_id), 128)
    return hf_s, single_hf


def _print_tables(console, results: dict, profile: list[tuple[str, float]], num_requests: int, dtype: str,
                  weights: str = "") -> None:
    """The throughput table (ours, and HF where measured), the ratio, and the profile's shares."""
    from rich.table import Table

    table = Table(title=f"Offline throughput: {num_requests} ShareGPT requests, {dtype}{weights}")
    for col in ("engine", "req/s", "output tok/s", "total tok/s", f"% of {dtype} peak", "1-request decode tok/s"):
        table.add_column(col, justify="right")
    for name in ("kvpilot", "hf_generate"):
        if name in results:
            r = results[name]
            table.add_row(name, f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                          f"{r['total_tokens_per_s']:.1f}", f"{100 * r['fraction_of_peak']:.1f}%",
                          f"{r['single_request_decode_tok_s']:.1f}")
    console.print(table)
    if "output_tokens_per_s_ratio" in results:
        console.print(f"kvpilot / HF generate output tokens/s: {results['output_tokens_per_s_ratio']:.2f}x")
    prof = Table(title="Where an engine step's time goes (decode-heavy steps, torch profiler)")
    prof.add_column("operator group")
    prof.add_column("share of wall time", justify="right")
    for group, share in profile:
        prof.add_row(group, f"{100 * share:.1f}%")
    console.print(prof)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(BY_NAME["dtype"].flag, default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: the engine's choice for this CPU (bf16 only with native bf16)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument(BY_NAME["max_num_seqs"].flag, type=int, default=256)
    p.add_argument(BY_NAME["max_num_batched_tokens"].flag, type=int, default=None)
    p.add_argument(BY_NAME["quantization"].flag, choices=["gguf", "none"], default=None,
                   help="unset: the engine's default (gguf for a GGUF model on CPU: the GGUF's Q4_1/Q8_0 blocks in "
                        "decode-sized matmuls, 8-bit activations unless "
                        f"{cpu_kernel_path.GGUF_ACTIVATIONS_ENV}=float32); none: our engine on the dense weights HF "
                        "loads too")
    p.add_argument("--skip-hf", action="store_true", help="only our engine (no ratio)")
    p.add_argument("--output-json", default="bench-results/throughput.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """`kvpilot bench throughput` (the module doc) into --output-json with the machine block. Returns
    0; exits 2 when --num-prompts < 1; RuntimeError when our engine cuts a request short."""
    p = _parser()
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    logging.basicConfig(level=logging.WARNING)
    from rich.console import Console

    from kvpilot.engine import LLM
    from kvpilot.engine.cpu.info import choose_auto_dtype, detect_cpu

    console = Console()
    cpu = detect_cpu()
    if args.dtype == "auto":
        choice = choose_auto_dtype("cpu", cpu)
        args.dtype = str(choice.dtype).removeprefix("torch.")
        console.print(f"dtype auto -> {args.dtype}: {choice.reason}")
    dtype = getattr(torch, args.dtype)
    load_before = loadavg()
    peak = measure_matmul_peak_gflops(dtype)
    console.print(f"{cpu.model_name}: {args.dtype} matmul peak (M=256, engine path) {peak:.0f} GFLOP/s")
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048, quantization=args.quantization)
    tokenizer = llm.get_tokenizer()
    requests = sample_sharegpt_requests(tokenizer, args.num_prompts, seed=args.seed)
    model = llm.engine.runner.model
    path = model.kernel_path or cpu_kernel_path.current()
    kernel_path = cpu_kernel_path.describe(model, path)
    console.print(kernel_path)
    ours_s, single_ours, profile = _time_ours(llm, requests, args.max_num_seqs)
    results = {"num_prompts": len(requests), "prompt_tokens": sum(r.prompt_len for r in requests),
               "output_tokens": sum(r.expected_output_len for r in requests), "dtype": args.dtype,
               "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads(),
               "cpu_kernel_path": kernel_path, "cpu_kernel_variant": path.variant, "matmul_peak_gflops": peak,
               "matmul_peak_dtype": args.dtype, "num_params": llm.engine.config.model.num_params(),
               "quantization": llm.engine.config.quantization}
    results["gguf_activations"] = path.gguf_activations if results["quantization"] == "gguf" else None
    results["kvpilot"] = _summary(ours_s, results) | {"single_request_decode_tok_s": single_ours}
    del llm
    if not args.skip_hf:
        hf_s, single_hf = _time_hf(args.model, dtype, tokenizer, requests, args.hf_batch_size)
        results["hf_generate"] = _summary(hf_s, results) | {"single_request_decode_tok_s": single_hf,
                                                            "batch_size": args.hf_batch_size}
        results["output_tokens_per_s_ratio"] = hf_s / ours_s
    weights = (f", kvpilot on the GGUF blocks ({results['gguf_activations']} activations)"
               if results["quantization"] == "gguf" else "")
    _print_tables(console, results, profile, len(requests), args.dtype, weights)
    results["profile_share"] = dict(profile)
    results["machine"] = machine_info(loadavg_before=load_before)
    write_result(args.output_json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
