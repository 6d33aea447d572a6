#!/usr/bin/env bash
# Installs the non-pip tools the operator tests need, idempotently (kubectl and helm are
# built with the control plane: `make controlplane`, controlplane/build.sh):
#   promtool  from Debian's prometheus package (skipped when already installed)
#   openssl   from Debian where missing (docs/guide.md makes its API key with it)
# Usage: scripts/install-tools.sh [VENV]   (default .venv)
set -euo pipefail
VENV="${1:-.venv}"
BIN="$VENV/bin"
PY="$BIN/python"
mkdir -p "$BIN"

apt_install() {  # Debian packages, as root or through sudo
    local sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if ! command -v promtool >/dev/null 2>&1; then
    apt_install prometheus
    echo "installed $(promtool --version 2>&1 | head -1)"
fi

# docs/guide.md makes its API key with openssl (tests/operator/test_user_guide.py runs it).
if ! command -v openssl >/dev/null 2>&1; then
    apt_install openssl
    echo "installed $(openssl version)"
fi

# issue 14: Grafana's own dashboard types (@grafana/schema) and TypeScript, for the
# `tsc --strict --noEmit` check of charts/kvpilot/dashboards/*.json (tests/operator/grafana_tsc.py).
# Node 20 and npm come from the machine (Debian's nodejs/npm where missing); pinned versions
# in $VENV/node, reinstalled only when a pin changes.
GRAFANA_SCHEMA_VERSION=13.2.3
TYPESCRIPT_VERSION=5.9.3
NODE_DIR="$VENV/node"
if ! grep -qs "\"version\": \"$GRAFANA_SCHEMA_VERSION\"" "$NODE_DIR/node_modules/@grafana/schema/package.json" \
   || ! grep -qs "\"version\": \"$TYPESCRIPT_VERSION\"" "$NODE_DIR/node_modules/typescript/package.json"; then
    if ! command -v npm >/dev/null 2>&1; then
        apt_install nodejs npm
    fi
    mkdir -p "$NODE_DIR"
    [ -f "$NODE_DIR/package.json" ] || echo '{"private": true}' > "$NODE_DIR/package.json"
    (cd "$NODE_DIR" && npm install --no-audit --no-fund --ignore-scripts --loglevel=error \
        "@grafana/schema@$GRAFANA_SCHEMA_VERSION" "typescript@$TYPESCRIPT_VERSION")
    echo "installed @grafana/schema $GRAFANA_SCHEMA_VERSION and typescript $TYPESCRIPT_VERSION to $NODE_DIR"
fi

# issue 16: podman, runc, slirp4netns, debootstrap for `make images` and tests/images
bash "$(dirname "$0")/../images/install-podman.sh"
