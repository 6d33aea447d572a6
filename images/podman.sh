#!/usr/bin/env bash
# podman with kvpilot's settings for build machines without a registry (DESIGN.md, "Container
# images here"): runc (crun fails where the host's cgroups are in hybrid mode), cgroupfs, ulimits
# within the host's hard limits, and image storage under one stable directory so that the base
# image and the build's layers are reused by later builds and test runs.
#   images/podman.sh build ...; images/podman.sh run ...       (any podman command)
#   KVPILOT_IMAGES_DIR   storage and settings (default ~/.cache/kvpilot-images)
set -euo pipefail
DIR="${KVPILOT_IMAGES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot-images}"
mkdir -p "$DIR/storage"
CONF="$DIR/containers.conf"
if [ ! -f "$CONF" ]; then
    cat > "$CONF.tmp" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
    mv "$CONF.tmp" "$CONF"
fi
export CONTAINERS_CONF="$CONF"
exec podman --root "$DIR/storage" --runroot "${XDG_RUNTIME_DIR:-/tmp}/kvpilot-images-run-$(id -u)" \
    --storage-driver overlay "$@"
