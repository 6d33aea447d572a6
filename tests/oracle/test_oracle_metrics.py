"""vLLM's metrics, checked against a running vLLM (issue 48 item 3): vLLM 0.32 (.venv-vllm) and
`kvpilot serve` on the builtin SmolLM2, each started once per flag set (the defaults, then
`--enable-mfu-metrics --kv-cache-metrics --custom-histogram-buckets ...`), given the same few
requests, then scraped: equal family names, types, label names and bucket bounds, but for the
rows of metric_differences.py (each with its reason; a row that no longer differs fails). With
the MFU flag both count the same FLOPs for the same tokens (vLLM's formula, kvpilot/engine/metrics/perf.py).
Measured on the 2-core Zen 4: 100 s for the two scrapes (vLLM's eager start-up each time, ours loads
meanwhile), about 15 s each for vLLM's checks of --custom-histogram-buckets and its MFU model."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from metric_differences import ONLY_KVPILOT, VERSION_LABELS, differences, expected, reduce

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from server_harness import ServerProcess, free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2-135m-instruct"
SHARED = ["--max-model-len", "2048", "--block-size", "32", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
FLAGS = {
    "defaults": [],
    "metric_flags": ["--enable-mfu-metrics", "--kv-cache-metrics", "--kv-cache-metrics-sample", "1",
                     "--custom-histogram-buckets", json.dumps({"request_latency": [0.1, 1, 10], "request_tokens": [8, 64],
                                                               "kv_cache_residency": [0.5, 5]})],
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def start_vllm(workdir: Path, flags: list[str]) -> tuple[subprocess.Popen, str]:
    """`vllm serve` as kvpilot's runtime vllm starts it (tuner/local/vllm_runtime.py), eager, 256 MiB of KV cache."""
    from kvpilot.tuner.search.feasibility import model_directory
    from kvpilot.tuner.local.vllm_runtime import served_name, vllm_environment, vllm_serve_command

    port = free_port()
    command = [*vllm_serve_command(), str(model_directory(f"builtin://{MODEL}")), "--served-model-name",
               served_name(MODEL), "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--kv-cache-memory-bytes", str(256 << 20), *SHARED, *flags]
    env = {k: v for k, v in vllm_environment().items() if k != "VLLM_API_KEY"}
    with (workdir / "vllm.log").open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"vllm serve not healthy in {timeout_s} s: {log.read_text(errors='replace')[-3000:]}")


def stop_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def workload(url: str) -> str:
    """The same requests to both: greedy, fixed output lengths (ignore_eos), distinct prompts
    (no prefix-cache hits), then a chat with tools and a streamed one (the tool parser runs; the
    servers render tools into the prompt differently). Returns /metrics after the completions."""
    with httpx.Client(base_url=url, timeout=120) as client:
        for prompt in ("The capital of France is", "Once upon a time, in a land far away,"):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        time.sleep(1.5)  # vLLM records a step's stats after its output is sent
        completions = client.get("/metrics").text
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
                "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 0
    return completions


@pytest.fixture(scope="module", params=sorted(FLAGS))
def scrapes(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str], list[str]]]:
    """(flag set, vLLM's /metrics after the completions and at the end, ours likewise); vLLM
    spawned first, ours loads meanwhile."""
    name = request.param
    workdir = tmp_path_factory.mktemp(f"oracle-metrics-{name}")
    proc, vllm_url = start_vllm(workdir, FLAGS[name])
    ours = ServerProcess(workdir / "ours.log", *SHARED, *FLAGS[name])
    try:
        ours.start()
        wait_healthy(proc, vllm_url, workdir / "vllm.log")
        texts = []
        for url in (vllm_url, ours.url):
            completions = workload(url)
            time.sleep(1.5)
            texts.append([completions, httpx.get(f"{url}/metrics", timeout=30).text])
        yield name, texts[0], texts[1]
    finally:
        ours.stop()
        stop_session(proc)


def test_families_types_labels_and_buckets_equal_vllms_but_for_the_table(scrapes):
    name, (_, vllm_text), (_, ours_text) = scrapes
    vllm, ours = reduce(vllm_text), reduce(ours_text)
    found, explained = differences(vllm, ours), expected()
    assert found == explained, {k: (found[k] ^ explained[k]) for k in found if found[k] != explained[k]}
    assert len(vllm) > 50 and ("vllm:kv_block_lifetime_seconds" in vllm) == (name == "metric_flags")
    assert "vllm:tool_call_parser_invocations" in vllm and "vllm:estimated_flops_per_gpu" in vllm
    assert set(ONLY_KVPILOT) | {label for _, label in VERSION_LABELS} and all(ONLY_KVPILOT.values())


def counter(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_mfu_and_tool_parser_counters_count_as_vllms(scrapes):
    name, (vllm_mid, vllm_text), (ours_mid, ours_text) = scrapes
    flops = [counter(t, "vllm:estimated_flops_per_gpu_total") for t in (vllm_mid, ours_mid)]
    if name == "defaults":
        assert flops == [0.0, 0.0]  # registered, not counting without --enable-mfu-metrics
    else:  # the same tokens, one request at a time: vLLM's estimate
        assert flops[0] > 0 and abs(flops[1] - flops[0]) / flops[0] < 0.01, flops
    for mode in ("non_streaming", "streaming"):
        counts = [counter(t, "vllm:tool_call_parser_invocations_total", mode=mode) for t in (vllm_text, ours_text)]
        assert counts[0] >= 1 and counts[1] >= 1, (mode, counts)
    assert counter(vllm_text, "vllm:tool_call_parser_invocations_total", mode="non_streaming") == counter(
        ours_text, "vllm:tool_call_parser_invocations_total", mode="non_streaming") == 1


BAD_BUCKETS = [{"nope": [1]}, {"request_latency": [2, 1]}, {"time_to_first_token": [0, 1]}, {"request_tokens": []},
               {"request_latency": [True]}]
VLLM_CHECK = """
import json, sys
from vllm.config.observability import ObservabilityConfig
out = []
for bad in json.loads(sys.argv[1]):
    try:
        ObservabilityConfig(custom_histogram_buckets=bad)
        out.append(None)
    except Exception as exc:  # pydantic's ValidationError, carrying the validator's message
        out.append(str(exc))
print(json.dumps(out))
"""


def test_bad_custom_buckets_get_vllms_messages():
    """vLLM's own ObservabilityConfig (what `vllm serve --custom-histogram-buckets` builds; it
    exits 1 with the ValidationError) refuses each value with the message kvpilot gives (kvpilot
    serve exits 2 with it, a usage error as for its other flags)."""
    from kvpilot.engine.metrics.options import check_custom_histogram_buckets
    from kvpilot.tuner.local.vllm_runtime import vllm_serve_command

    done = subprocess.run([vllm_serve_command()[0], "-P", "-c", VLLM_CHECK, json.dumps(BAD_BUCKETS)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for bad, theirs in zip(BAD_BUCKETS, json.loads(done.stdout.strip().splitlines()[-1])):
        with pytest.raises(ValueError) as ours:
            check_custom_histogram_buckets(bad)
        assert theirs is not None and str(ours.value) in theirs, (bad, str(ours.value), theirs)


VLLM_PERF = """
import json, sys
from vllm.v1.metrics.perf import AttentionMetrics, ExecutionContext, FfnMetrics, UnembedMetrics
def estimate(m, batches):
  common = dict(num_hidden_layers=m["L"], hidden_size=m["D"], activation_byte_size=m["b"], pp_size=m["pp"],
              weight_byte_size=m["b"])
  parts = [AttentionMetrics(**common, num_attention_heads=m["q"], tp_size=m["tp"], num_key_value_heads=m["kv"],
                          head_dim=m["d"], cache_byte_size=m["b"]),
         FfnMetrics(**common, ffn_tp_size=m["tp"], ffn_ep_size=1, intermediate_size=m["I"], num_moe_layers=0),
         UnembedMetrics(hidden_size=m["D"], vocab_size=m["V"], weight_byte_size=m["b"], activation_byte_size=m["b"],
                        tp_size=m["tp"])]
  out = []
  for batch in batches:
    ctx = ExecutionContext()
    for n, c, p in batch:
      ctx.add(n, c, p)
    out.append([sum(f(ctx) for f in fs) for fs in ([p.get_num_flops for p in parts], [p.get_read_bytes for p in parts],
                                                   [p.get_write_bytes for p in parts])])
  return out
shapes, batches = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps([estimate(m, batches) for m in shapes]))
"""


def test_the_mfu_estimate_is_vllms_perf_model():
    """kvpilot/engine/metrics/perf.py against vLLM's own AttentionMetrics + FfnMetrics +
    UnembedMetrics (vllm/v1/metrics/perf.py) for SmolLM2's shape, prefills, decodes and a
    mixed chunked step, per device under tensor and pipeline parallelism."""
    import dataclasses

    from kvpilot.engine import EngineArgs
    from kvpilot.engine.metrics.perf import PerfEstimator
    from kvpilot.tuner.local.vllm_runtime import vllm_serve_command

    base = EngineArgs(max_model_len=2048, num_gpu_blocks_override=64, dtype="bfloat16",
                      quantization="none").create_engine_config()
    configs = [dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, tensor_parallel_size=tp,
                                                                      pipeline_parallel_size=pp))
               for tp, pp in ((1, 1), (3, 2))]
    mc = base.model
    shapes = [{"L": mc.num_layers, "D": mc.hidden_size, "q": mc.num_heads, "kv": mc.num_kv_heads, "d": mc.head_dim,
               "I": mc.intermediate_size, "V": mc.vocab_size, "b": 2, "tp": c.parallel.tensor_parallel_size,
               "pp": c.parallel.pipeline_parallel_size} for c in configs]
    batches = [[[100, 100, True]], [[1, 50, False], [1, 70, False]], [[37, 137, True], [1, 20, False], [5, 9, True]]]
    done = subprocess.run([vllm_serve_command()[0], "-P", "-c", VLLM_PERF, json.dumps(shapes), json.dumps(batches)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [[[p.flops, p.read_bytes, p.write_bytes] for p in map(PerfEstimator(c).step, batches)] for c in configs]
    assert ours == theirs
