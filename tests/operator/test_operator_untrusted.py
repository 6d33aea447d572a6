"""Untrusted InferenceService fields: extraArgs are read by `kvpilot serve`'s own parser (or
a deny-list for runtime vllm), env may not set what the operator sets, and the API key
reaches the engine only through its environment. Pure: no cluster."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvpilot.operator.render.builders import build_configmap, build_deployment
from kvpilot.operator.render.engine_args import engine_command
from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.operator.validation import InvalidSpec, validate

SMOLLM = {"source": "builtin://smollm2-135m-instruct"}


def spec(model=SMOLLM, **engine) -> InferenceServiceSpec:
    return InferenceServiceSpec.from_dict({"model": model, "engine": engine})


def refusal(s: InferenceServiceSpec) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        validate(s)
    return info.value


# The bypasses of issue 17 (an abbreviation, a short form, `=` forms, a negation), and more.
OWNED_SPELLINGS = [
    ["--api-k="],
    ["--api-key="],
    ["--api-key", "x"],
    ["--max-num-seq", "9999"],
    ["--max-num-seqs", "9999"],
    ["--max-num-seqs=9999"],
    ["-tp", "3"],
    ["-tp=3"],
    ["-t", "3"],  # argparse (3.11) still matches a single-dash prefix with allow_abbrev=False
    ["--tensor-parallel-size=3"],
    ["-pp", "2"],
    ["--no-enable-chunked-prefill"],
    ["--enable-chunked-prefill"],
    ["--enable-prefix-caching"],
    ["--port", "9000"],
    ["--host=127.0.0.1"],
    ["--enable-admin-routes"],
    ["--disable-log-stats", "--seed", "7"],
    ["--served-model-name", "other"],  # rendered from spec.model.name
]


@pytest.mark.parametrize("extra", OWNED_SPELLINGS, ids=" ".join)
def test_kvpilot_refuses_every_spelling_of_an_owned_flag(extra):
    e = refusal(spec(extraArgs=extra))
    assert e.reason == "ConflictingArgs", e.message


@pytest.mark.parametrize("extra", [["--no-such-flag"], ["--disable-log-stat"], ["extra-positional"],
                                   ["--max-queue-len", "many"], ["--", "--api-key=x"]], ids=" ".join)
def test_kvpilot_refuses_flags_its_parser_does_not_know(extra):
    e = refusal(spec(extraArgs=extra))
    assert e.reason == "ConflictingArgs" and "not valid" in e.message, e.message


def test_kvpilot_accepts_its_other_flags_and_the_engine_parses_them_the_same_way():
    extra = ["--disable-log-stats", "--max-queue-len=32", "--request-deadline-s", "60",
             "--num-gpu-blocks-override", "256"]
    s = spec(extraArgs=extra)
    validate(s)
    from kvpilot.engine.entrypoints.serve import make_parser

    ns = make_parser().parse_args(engine_command(s)[2:])
    assert (ns.max_queue_len, ns.request_deadline_s, ns.num_gpu_blocks_override) == (32, 60.0, 256)
    assert ns.tensor_parallel_size == 1 and ns.max_num_seqs == s.engine.maxNumSeqs


@pytest.mark.parametrize("extra", [["--api-key=x"], ["--api-k", "x"], ["--max_num_seqs", "9999"],
                                   ["-tp", "3"], ["-tp3"], ["--no-enable-chunked-prefill"],
                                   ["--config", "/tmp/x.yaml"], ["--tensor-parallel-size=2"], ["--port=1"]],
                         ids=" ".join)
def test_vllm_deny_list_refuses_owned_flags_in_any_spelling(extra):
    e = refusal(spec(model={"source": "/models/llama"}, runtime="vllm", blockSize=128, extraArgs=extra))
    assert e.reason == "ConflictingArgs", e.message


def test_vllm_allows_flags_the_operator_does_not_own():
    validate(spec(model={"source": "/models/llama"}, runtime="vllm", blockSize=128,
                  extraArgs=["--max-loras", "2", "--enable-lora", "--kv-cache-dtype=fp8"]))


def test_parsing_extra_args_does_not_import_torch():
    code = ("import sys; from kvpilot.operator.validation import validate; "
            "from kvpilot.api.spec import InferenceServiceSpec as S; "
            "validate(S.from_dict({'model': {'source': '/m'}, 'engine': {'extraArgs': ['--disable-log-stats']}})); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", ["VLLM_API_KEY", "KVPILOT_API_KEY", "KVPILOT_ADMIN_TOKEN",
                                  "VLLM_TORCH_PROFILER_DIR", "HOME", "TMPDIR"])
def test_env_may_not_set_a_variable_the_operator_sets(name):
    e = refusal(spec(apiKeySecret={"name": "keys"}, env=[{"name": name, "value": "x"}]))
    assert e.reason == "ReservedEnv" and name in e.message


def test_api_key_reaches_the_engine_only_through_its_environment():
    s = spec(apiKeySecret={"name": "keys", "key": "k"}, env=[{"name": "LOG_LEVEL", "value": "debug"}])
    validate(s)
    container = build_deployment("a", "ns", s)["spec"]["template"]["spec"]["containers"][0]
    words = container["command"] + container["args"]
    assert not any("API_KEY" in w or "api-key" in w for w in words), words
    env = {e["name"]: e for e in container["env"]}
    assert env["VLLM_API_KEY"] == {"name": "VLLM_API_KEY",
                                   "valueFrom": {"secretKeyRef": {"name": "keys", "key": "k"}}}
    names = [e["name"] for e in container["env"]]
    assert names.index("LOG_LEVEL") < names.index("VLLM_API_KEY")  # the operator's values come last
    assert "API_KEY" not in build_configmap("a", "ns", s)["data"]["command"]
