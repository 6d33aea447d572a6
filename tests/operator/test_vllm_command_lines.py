"""Every `vllm serve` command line the operator renders for `runtime: vllm` is one the pinned
upstream vLLM (kvpilot.api.vllm, installed by scripts/install-vllm.sh into .venv-vllm) accepts:
its own argument parser, built as its CLI builds it, plus its serve validation and
EngineArgs.from_cli_args (tests/operator/vllm_serve_parse.py, run by vLLM's Python). The specs
vary every spec.engine setting over its choices, bounds and both boolean forms, one at a time
from the defaults, on CPU and GPU pods, and as node 0 and a headless node of a multi-pod group.
A spec the operator accepts renders a command vLLM accepts; a spec vLLM would refuse is refused
by the operator first (a Failed condition), never a pod that exits 2."""
from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kube.tools import ROOT

from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.api.vllm import VLLM_CPU_BLOCK_SIZE_MULTIPLE, VLLM_CPU_DEFAULT_BLOCK_SIZE, VLLM_VERSION
from kvpilot.engine import settings
from kvpilot.operator.render.builders import build_deployment
from kvpilot.operator.render.group_builders import build_group_children
from kvpilot.operator.validation import InvalidSpec, validate

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PARSE = ROOT / "tests" / "operator" / "vllm_serve_parse.py"
MODEL = "/models/llama"


def vllm_parse(argvs: list[list[str]]) -> list[dict[str, Any]]:
    """vLLM's verdict on each argv (the words after the program)."""
    assert VLLM_PYTHON.exists(), "make test installs the pinned vLLM into .venv-vllm (scripts/install-vllm.sh)"
    out = subprocess.run([str(VLLM_PYTHON), "-P", str(PARSE)], input=json.dumps(argvs), capture_output=True,
                         text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def setting_values(setting: settings.Setting) -> list[Any]:
    """Values of one spec.engine setting that the CRD admits: its choices, both booleans, its
    bounds and a value inside them, its special values."""
    if setting.choices:
        return list(setting.choices)
    if setting.type is bool:
        return [True, False]
    if setting.type in (int, float):
        low = setting.minimum if setting.minimum is not None else 0
        high = setting.maximum if setting.maximum is not None else 4096
        if setting.exclusive_minimum:
            low = low + (0.05 if setting.type is float else 1)
        values = [setting.type(low), setting.type(high), setting.type((low + high) / 2)]
        return values + list(setting.special)
    if setting.name == "show_hidden_metrics_for_version":
        return ["", "0.8", "0.10", "0.11", "0.31"]
    if setting.name == "structured_outputs_config":
        return ['{"backend": "xgrammar"}', '{"backend": "auto"}', '{"backend": "xgrammar", "disable_any_whitespace": true}']
    if setting.name == "tool_call_parser":
        return ["hermes"]
    return []


def specs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, spec dict) of the examples with runtime vllm, then every setting value on CPU and
    GPU, then the multi-pod layouts."""
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if doc["spec"].get("engine", {}).get("runtime") == "vllm":
            yield f"example {path.name}", doc["spec"]
    for gpu in (False, True):
        # blockSize unset: the operator gives vLLM's CPU default on CPU nodes (16 is refused there)
        common = {"runtime": "vllm"}
        base = {"model": {"source": MODEL}, "engine": common, "resources": {"gpu": gpu}}
        yield f"defaults gpu={gpu}", base
        for setting in settings.SETTINGS:
            if not setting.crd:
                continue
            for value in setting_values(setting):
                engine = {**common, setting.crd: value}
                if setting.name in ("max_num_seqs", "max_model_len"):  # keep the budget rule satisfiable
                    engine["maxNumBatchedTokens"] = 1048576
                if setting.name == "tool_call_parser":
                    engine["enableAutoToolChoice"] = True
                yield f"{setting.crd}={value!r} gpu={gpu}", {**base, "engine": engine}
        for tp, pp, nnodes in ((2, 1, 2), (1, 2, 2), (2, 2, 2), (2, 2, 4)):
            yield f"tp={tp} pp={pp} nnodes={nnodes} gpu={gpu}", {
                **base, "engine": {**common, "tensorParallelSize": tp, "pipelineParallelSize": pp},
                "parallelism": {"nnodes": nnodes}}


def rendered(spec: InferenceServiceSpec) -> list[list[str]]:
    """The argv after the program of every engine container the operator renders for `spec`
    (a group's `$(VAR)`s expanded as the kubelet would: node 0's address, rank 1)."""
    if spec.nnodes > 1:
        pods = [o["spec"]["template"] for o in build_group_children("m", "ns", spec) if o["kind"] == "StatefulSet"]
    else:
        pods = [build_deployment("m", "ns", spec)["spec"]["template"]]
    argvs = []
    for pod in pods:
        container = pod["spec"]["containers"][0]
        words = container["command"] + container["args"]
        words = words[words.index("vllm"):]  # on CPU nodes the launcher runs it
        expanded = [w.replace("$(LWS_LEADER_ADDRESS)", "m-0.m.ns.svc").replace("$(LWS_WORKER_INDEX)", "1")
                    for w in words]
        argvs.append(expanded[1:])
    return argvs


def test_the_pinned_vllm_accepts_every_command_line_the_operator_renders(capsys):
    cases: list[tuple[str, list[str]]] = []
    refused: list[tuple[str, str, list[str]]] = []  # (label, reason, the command it would have run)
    for label, body in specs():
        spec = InferenceServiceSpec.from_dict(body)
        try:
            validate(spec)
        except InvalidSpec as exc:
            refused.append((label, exc.reason, rendered(spec)[0]))
            continue
        cases += [(label, argv) for argv in rendered(spec)]
    verdicts = vllm_parse([argv for _, argv in cases] + [argv for _, _, argv in refused])
    accepted, on_refused = verdicts[:len(cases)], verdicts[len(cases):]
    failures = [f"{label}: {v['error']}\n    vllm {' '.join(argv)}" for (label, argv), v in zip(cases, accepted)
                if not v["ok"]]
    assert not failures, f"vLLM {VLLM_VERSION} refuses:\n" + "\n".join(failures)
    assert len(cases) > 100
    # What the operator refuses first (a Failed condition instead of a pod exiting 2): a setting vLLM
    # removed, set to anything but its default (rendered without the flag, vLLM would not honour it),
    # and what vLLM's own checks refuse (auto tool choice without a parser, a budget below max_num_seqs).
    assert sum(label.startswith("example ") for label, _ in cases) == 2  # CPU (builtin) and GPU
    block_sizes = {label: settings.flag_value(argv, "block_size") for label, argv in cases
                   if label.startswith("defaults")}  # blockSize unset: vLLM's default for the devices
    assert block_sizes == {"defaults gpu=False": str(VLLM_CPU_DEFAULT_BLOCK_SIZE), "defaults gpu=True": "16"}
    assert {label.split("=")[0] for label, _, _ in refused} == {
        "swapSpace", "preemptionMode", "enableAutoToolChoice", "maxNumBatchedTokens", "blockSize"}, refused
    assert {label for label, _, _ in refused if label.startswith("blockSize")} == {
        f"blockSize={b} gpu=False" for b in (1, 2, 4, 8, 16)}  # vLLM's CPU attention (next test)
    not_refused_by_vllm = [label for (label, reason, _), v in zip(refused, on_refused)
                           if reason != "UnsupportedByVLLM" and v["ok"]]
    assert not_refused_by_vllm == [], "the operator refuses what vLLM accepts"
    with capsys.disabled():
        print(f"\n[vllm parser] vLLM {VLLM_VERSION} accepted {len(cases)} rendered command lines; the operator "
              f"refused {len(refused)} specs first")


def test_vllm_refuses_what_the_operator_no_longer_renders():
    """The check has teeth: the flags the operator dropped for vLLM are refused by vLLM's parser,
    and a value out of vLLM's own range is refused by its validation."""
    limits = ["serve", MODEL, "--max-num-seqs", "8", "--max-num-batched-tokens"]
    verdicts = vllm_parse([["serve", MODEL, "--swap-space", "4"], ["serve", MODEL, "--preemption-mode", "recompute"],
                           [*limits, "4"], [*limits, "64"]])
    assert [v["ok"] for v in verdicts] == [False, False, False, True]
    assert "unrecognized arguments: --swap-space" in verdicts[0]["error"]
    assert "must be greater than or equal to max_num_seqs" in verdicts[2]["error"]


def test_the_cpu_block_size_rule_is_vllms_own():
    """What vLLM's CPU attention backend says it takes, asked of the pinned vLLM itself."""
    out = subprocess.run([str(VLLM_PYTHON), "-P", "-c", "from vllm.v1.attention.backends.cpu_attn import "
                          "CPUAttentionBackend as B; print(B.get_supported_kernel_block_sizes())"],
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert out.stdout.strip().splitlines()[-1] == f"[MultipleOf({VLLM_CPU_BLOCK_SIZE_MULTIPLE})]", out.stderr[-2000:]
    assert VLLM_CPU_DEFAULT_BLOCK_SIZE % VLLM_CPU_BLOCK_SIZE_MULTIPLE == 0


@pytest.mark.parametrize("runtime", ["kvpilot", "vllm"])
def test_the_chart_and_the_operator_default_to_the_pinned_vllm_release(runtime):
    from kvpilot.api.vllm import VLLM_CUDA_IMAGE
    from kvpilot.operator.render.builders import Images

    values = yaml.safe_load((ROOT / "charts" / "kvpilot" / "values.yaml").read_text())
    assert values["engineImages"]["vllm"] == VLLM_CUDA_IMAGE == Images().for_runtime("vllm", gpu=True)
    assert VLLM_CUDA_IMAGE.endswith(f":v{VLLM_VERSION}")
    assert Images().for_runtime("vllm", gpu=False) == "kvpilot/engine-vllm-cpu:0.1.0"
    assert Images().for_runtime(runtime, gpu=False).startswith("kvpilot/engine-")
