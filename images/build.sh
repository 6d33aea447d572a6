#!/usr/bin/env bash
# Builds kvpilot's images with podman: `images/build.sh [TARGET...]` (default engine-cpu
# engine-vllm-cpu operator; engine-cuda too when asked). Tags kvpilot/TARGET:VERSION (VERSION from
# pyproject.toml, the chart's appVersion). Makes the base image first when BASE is the local
# default. The host's pip CA bundle and find-links directory (pip config, or PIP_CERT /
# PIP_FIND_LINKS) are bind-mounted into the build's RUN steps only, never copied into a layer.
#   BASE=registry.example.com/debian:bookworm images/build.sh     # your own base
#   KVPILOT_IMAGES_DIR   podman's storage (default ~/.cache/kvpilot-images), kept between builds
# The store does not grow from build to build: each target's deps and build stages are tagged
# kvpilot-cache/STAGE (the layer cache the next build reuses), and what an earlier build left
# untagged (older generations, build containers of an interrupted build) is removed; builds
# sharing one store take turns (flock).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$HERE")"
PODMAN="$HERE/podman.sh"
BASE="${BASE:-localhost/debian:bookworm}"
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(engine-cpu engine-vllm-cpu operator)
VERSION="$(python3 -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' "$ROOT/pyproject.toml")"

bash "$HERE/install-podman.sh"
STORE="${KVPILOT_IMAGES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot-images}"
mkdir -p "$STORE"
exec 9>"$STORE/build.lock"
flock 9
# A build killed midway leaves buildah's working containers (status "Storage"); they pin every
# layer under them until removed. None is in use while this build holds the lock.
"$PODMAN" ps -a --external --format '{{.ID}} {{.Status}}' | awk '$2 == "Storage" {print $1}' \
    | xargs -r "$PODMAN" rm -f >/dev/null
[ "$BASE" != "localhost/debian:bookworm" ] || bash "$HERE/build-base.sh" "$BASE"

pip_setting() {  # the host's pip setting $1 (cert, find-links): env first, then pip config
    local env="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
    if [ -n "${!env:-}" ]; then echo "${!env}"; return; fi
    python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.$1='\(.*\)'\$/\1/p" | head -1
}
args=(--build-arg "BASE=$BASE" --ignorefile "$HERE/containerignore" -f "$HERE/Containerfile")
cert="$(pip_setting cert)"
if [ -n "$cert" ] && [ -f "$cert" ]; then
    args+=(-v "$cert:/run/kvpilot-build/ca.crt:ro" --build-arg PIP_CERT=/run/kvpilot-build/ca.crt)
fi
links="$(pip_setting find-links)"
if [ -n "$links" ] && [ -d "$links" ]; then
    args+=(-v "$links:/run/kvpilot-build/wheels:ro" --build-arg PIP_FIND_LINKS=/run/kvpilot-build/wheels)
fi
# A layer that does not fit fails inside podman's commit with a bare "read/write on closed pipe";
# the free space before and at a failure says whether that was the disk.
free_space() { df -h --output=avail,target "$STORE" | tail -1 | awk '{print $1 " free on " $2}'; }
echo "image store $STORE: $(free_space)"
trap 'echo "make images failed with $(free_space) (a fresh build of every target needs about 17 GB)" >&2' ERR
for target in "${TARGETS[@]}"; do
    echo "building kvpilot/$target:$VERSION"
    for stage in "$target-deps" "$target-build"; do  # those the Containerfile has (engine-vllm-cpu: -build only)
        grep -qE "^FROM .* AS $stage\$" "$HERE/Containerfile" || continue
        "$PODMAN" build "${args[@]}" --layers --target "$stage" -t "localhost/kvpilot-cache/$stage:latest" "$ROOT"
    done
    "$PODMAN" build "${args[@]}" --layers --target "$target" -t "kvpilot/$target:$VERSION" "$ROOT"
done
# Untagged images nothing depends on: earlier generations of the stages above. One pass removes
# the leaves only, so repeat until a pass removes nothing.
while [ -n "$("$PODMAN" image prune -f)" ]; do :; done
