"""The images `make images` builds, run the way a cluster runs them: the CPU engine with the
pod spec the operator renders for examples/inferenceservice-smollm2.yaml (and the in-cluster
tuner's load built against it from the operator image), the operator with the chart's
Deployment, each through tests/images/pod_to_podman.py (uid 1000, read-only root, no
capabilities, only the pod's volumes)."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml
from kube.tools import ROOT, Kubectl, free_port, helm_template, wait_for
from openai import OpenAI
from pod_to_podman import PodmanRun, podman_run
from podman_tools import VERSION, podman

from kvpilot.operator.builders import build_configmap, build_deployment
from kvpilot.operator.engine_args import ADMIN_TOKEN_ENV
from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.kernels.cpu.loader import selected_variant
from kvpilot.tuner.settings import EngineSettings

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "inferenceservice-smollm2.yaml"


@contextlib.contextmanager
def running(run: PodmanRun, *extra: str) -> Iterator[str]:
    """Starts the container detached; yields its name; removes it (logs kept in the failure)."""
    name = run.argv[run.argv.index("--name") + 1]
    podman("rm", "-f", name, check=False)
    podman("run", "-d", *extra, *run.argv, *run.command, env={**os.environ, **run.env})
    try:
        yield name
    finally:
        podman("rm", "-f", name, check=False, timeout=60)


def wait_http(url: str, name: str, timeout: float) -> httpx.Response:
    """Polls url until it answers 200, failing early (with the log) if the container exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
        assert state == "running", f"{name} is {state}:\n{podman('logs', name).stdout[-4000:]}"
        with contextlib.suppress(httpx.TransportError):
            response = httpx.get(url, timeout=3)
            if response.status_code == 200:
                return response
        time.sleep(1)
    raise AssertionError(f"{url} did not answer 200 in {timeout} s:\n{podman('logs', name).stderr[-4000:]}")


def proc1(name: str) -> tuple[str, str]:
    """(the Uid: line of the container's main process, the options of its root mount)."""
    status = podman("exec", name, "cat", "/proc/1/status").stdout
    mountinfo = podman("exec", name, "cat", "/proc/1/mountinfo").stdout
    root = next(line.split() for line in mountinfo.splitlines() if line.split()[4] == "/")
    return next(line for line in status.splitlines() if line.startswith("Uid:")), root[5]


def test_engine_image_serves_a_chat_completion_as_the_operators_pod_would(images, tmp_path, capsys):
    manifest = yaml.safe_load(EXAMPLE.read_text())
    name, spec = manifest["metadata"]["name"], InferenceServiceSpec.from_dict(manifest["spec"])
    pod = build_deployment(name, "default", spec)["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == images["engine-cpu"], "the operator's default engine image is what make images tags"
    configmap = build_configmap(name, "default", spec)
    port = free_port()
    run = podman_run(pod, images["engine-cpu"], tmp_path, {spec.engine.port: port},
                     {configmap["metadata"]["name"]: configmap["data"]}, {ADMIN_TOKEN_ENV: secrets.token_urlsafe(24)})
    for flag in ("--read-only", "--cap-drop", "no-new-privileges", "1000:1000"):
        assert flag in run.argv
    with running(run) as container:
        wait_http(f"http://127.0.0.1:{port}/health", container, timeout=420)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=spec.model.display_name, max_tokens=16,
                                               messages=[{"role": "user", "content": "Say hello."}])
        answer = reply.choices[0].message.content
        start = time.monotonic()  # a decode figure: one request of up to 64 new tokens, alone
        timed = client.completions.create(model=spec.model.display_name, prompt="Once upon a time", max_tokens=64,
                                          temperature=0)
        decode_tok_s = timed.usage.completion_tokens / (time.monotonic() - start)
        load = operator_image_builds_the_tuners_load(images["operator"], port, spec.model.display_name,
                                                     EngineSettings.from_engine_spec(manifest["spec"]["engine"]))
        counted = [client.completions.create(model=spec.model.display_name, prompt=prompt, max_tokens=1)
                   .usage.prompt_tokens for prompt, _, _ in load["requests"]]
        uid, root_options = proc1(container)
        write = podman("exec", container, "touch", "/opt/kvpilot/probe", check=False)
        log = podman("logs", container).stdout + podman("logs", container).stderr
    assert answer and answer.strip()
    assert uid.split()[1:] == ["1000"] * 4, uid
    assert "ro" in root_options.split(","), root_options
    assert write.returncode != 0 and "Read-only file system" in write.stderr
    cache = run.volumes["/home/kvpilot/.cache"]
    assert not (cache / "kvpilot" / "models").exists(), "the pod converted the builtin model instead of using the baked one"
    assert "converting" not in log
    # the C kernels built at install time run inside the image (no compiler there), in the variant
    # this CPU runs best (the host's CPU is the container's)
    variant = selected_variant()
    path_line = next((line for line in log.splitlines() if "decode steps run" in line), "")
    assert f"runs the {variant} kernel build" in path_line, log[-4000:]
    assert "the torch path" not in path_line and "C " in path_line, path_line
    assert timed.usage.completion_tokens >= 1
    assert load["missing"] == ["torch", "transformers"]  # the load came without a local tokenizer or model
    assert len(load["requests"]) == 3 and all(prompt.strip() for prompt, _, _ in load["requests"])
    assert [n for _, n, _ in load["requests"]] == counted  # ShareGPT prompts with the engine's own token counts
    assert all(4 <= n <= 200 and 1 <= out <= 16 for _, n, out in load["requests"])
    with capsys.disabled():
        print(f"\n[engine image {images['engine-cpu']}] podman run {' '.join(run.argv)} {' '.join(run.command)}"
              f"\n[engine image] process {uid.replace(chr(9), ' ')}; root filesystem mounted {root_options}"
              f"\n[engine image] chat completion from {spec.model.display_name}: {answer!r}"
              f"\n[engine image] {path_line.strip()}"
              f"\n[engine image] one request: {timed.usage.completion_tokens} tokens at {decode_tok_s:.1f} tok/s "
              f"(prefill included; load average {os.getloadavg()[0]:.2f})"
              f"\n[operator image] the tuner's ShareGPT load through the engine's /tokenize in {load['seconds']} s: "
              f"prompt tokens {counted}")


def operator_image_builds_the_tuners_load(image: str, port: int, model: str, settings: EngineSettings) -> dict:
    """What the in-cluster tuner does before its first window (kvpilot.tuner.cluster_session),
    in the operator image against the engine container on the host's loopback port (reached
    through slirp4netns at 10.0.2.2): ShareGPT requests tokenized by the engine's /tokenize.
    Returns {"missing": modules absent from the image, "requests": [[prompt, prompt_len,
    output_len], ...], "seconds": how long the load took}."""
    script = (
        "import importlib.util as u, json, time\n"
        "from kvpilot.tuner.remote_tokenizer import RemoteTokenizer\n"
        "from kvpilot.tuner.workload import Workload, load_requests\n"
        "t0 = time.monotonic()\n"
        f"tok = RemoteTokenizer('http://10.0.2.2:{port}', {model!r})\n"
        "w = Workload(num_requests=3, warmup_requests=0, max_prompt_len=200, max_output_len=16)\n"
        f"load = load_requests(tok, w, {settings.max_model_len})\n"
        "print(json.dumps({'missing': [m for m in ('torch', 'transformers') if u.find_spec(m) is None],\n"
        "                  'requests': [[r.prompt, r.prompt_len, r.expected_output_len] for r in load.requests],\n"
        "                  'seconds': round(time.monotonic() - t0, 1)}))\n")
    out = podman("run", "--rm", "--network", "slirp4netns:allow_host_loopback=true", "--read-only",
                 "--entrypoint", "python3", image, "-c", script, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_operator_image_runs_the_charts_operator_and_answers_its_liveness_probe(images, cluster, tmp_path, capsys):
    watch = f"--set=watch.namespaces={{{cluster.namespace}}}"
    deployment = next(d for d in helm_template(watch) if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == images["operator"], "the chart's operator image is what make images tags"
    probe = container["livenessProbe"]["httpGet"]
    port_of = {p["name"]: p["containerPort"] for p in container["ports"]}
    ports = {p: free_port() for p in port_of.values()}
    kubectl = Kubectl(cluster.kubeconfig)
    kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml"))
    # In place of the pod's service-account token: the admin's kubeconfig, for the API
    # server that the container reaches on the host's loopback through slirp4netns
    # (10.0.2.2, a name in the API server's serving certificate).
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(cluster.kubeconfig.read_text().replace("127.0.0.1", "10.0.2.2"))
    kubeconfig.chmod(0o644)
    run = podman_run(pod, images["operator"], tmp_path, ports, {},
                     {"KVPILOT_OPERATOR_NAMESPACE": "kvpilot-system"})
    extra = ("--network", "slirp4netns:allow_host_loopback=true", "-v", f"{kubeconfig}:/var/run/kvpilot/kubeconfig:ro",
             "-e", "KUBECONFIG=/var/run/kvpilot/kubeconfig")
    with running(run, *extra) as name:
        healthz = wait_http(f"http://127.0.0.1:{ports[port_of[probe['port']]]}{probe['path']}", name, timeout=300)
        kubectl.apply(EXAMPLE)
        engine_image = next(e["value"] for e in container["env"] if e["name"] == "KVPILOT_ENGINE_IMAGE")
        created = wait_for(lambda: kubectl.json("get", "deployment", "smollm2")["spec"]["template"]["spec"]
                           ["containers"][0]["image"], timeout=120, what="the engine Deployment")
        uid, root_options = proc1(name)
    assert created == engine_image
    assert uid.split()[1:] == ["1000"] * 4, uid
    assert "ro" in root_options.split(",")
    with capsys.disabled():
        print(f"\n[operator image {images['operator']}] {' '.join(container['command'] + container['args'])}: "
              f"{probe['path']} answered {healthz.status_code}, created Deployment smollm2 ({created}); "
              f"process {uid.replace(chr(9), ' ')}, root filesystem {root_options}")


@pytest.mark.parametrize("target", ["engine-cpu", "operator"])
def test_images_carry_no_compiler_and_the_operator_no_torch(images, target):
    probe = podman("run", "--rm", "--entrypoint", "python3", images[target], "-c",
                   "import importlib.util as u, shutil; print([t for t in ('cc', 'gcc', 'g++', 'make', 'pip') "
                   "if shutil.which(t)], u.find_spec('torch') is not None)")
    tools, has_torch = probe.stdout.strip().rsplit(" ", 1)
    assert tools == "[]"
    assert has_torch == ("True" if target == "engine-cpu" else "False")
    if target == "engine-cpu":  # the CPU kernels, built in the build stage for every x86 level
        built = podman("run", "--rm", "--entrypoint", "python3", images[target], "-c",
                       "from kvpilot.kernels.cpu import build, loader; m = loader.manifest(); "
                       "print(sorted(m['variants']) == sorted(v.name for v in build.variants()) "
                       "and all(build.library_path(loader.LIB_DIR, v, n).exists() for v in m['variants'] "
                       "for n in build.LIBRARIES))")
        assert built.stdout.strip() == "True", built.stdout + built.stderr


def test_image_tags_follow_the_project_version(images):
    chart = yaml.safe_load((ROOT / "charts" / "kvpilot" / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
    assert all(tag.endswith(f":{VERSION}") for tag in images.values())


def test_make_images_leaves_no_untagged_image_or_build_container_behind(images):
    """Each build would otherwise add GBs of orphaned layers (the engine's venv) to the store until
    the disk fills: images/build.sh tags its cache stages and prunes the rest."""
    dangling = podman("images", "--filter", "dangling=true", "--format", "{{.ID}}").stdout.split()
    assert dangling == []
    statuses = podman("ps", "-a", "--external", "--format", "{{.Status}}").stdout.split("\n")
    assert "Storage" not in [s.strip() for s in statuses]
    cache = podman("images", "--format", "{{.Repository}}", "--filter", "reference=localhost/kvpilot-cache/*").stdout.split()
    assert {f"localhost/kvpilot-cache/{t}-{s}" for t in images for s in ("deps", "build")} <= set(cache)
