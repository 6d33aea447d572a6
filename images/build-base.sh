#!/usr/bin/env bash
# Makes the base image localhost/debian:bookworm from Debian's packages (no registry needed):
# debootstrap --variant=minbase into a temp dir, then `podman import`. Idempotent: does nothing
# when the image exists. Users with a registry skip this and pass --build-arg BASE=their/debian.
#   images/build-base.sh [IMAGE]     (default localhost/debian:bookworm)
#   MIRROR  Debian mirror (default: the first one in this machine's apt sources)
#   SUITE   Debian release (default bookworm: its python3 is 3.11, as the torch wheel wants)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
IMAGE="${1:-localhost/debian:bookworm}"
SUITE="${SUITE:-bookworm}"
PODMAN="$HERE/podman.sh"

if "$PODMAN" image exists "$IMAGE"; then
    echo "base image $IMAGE exists"
    exit 0
fi
if [ -z "${MIRROR:-}" ]; then
    # deb822 (URIs: ...) or one-line (deb URL suite ...) sources; the first plain Debian archive
    MIRROR="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2}' | grep -v security | head -1 || true)"
    [ -n "$MIRROR" ] || MIRROR="$(awk '/^deb / && !/security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)"
    [ -n "$MIRROR" ] || MIRROR="http://deb.debian.org/debian"
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
ROOTFS="$(mktemp -d)"
trap '$SUDO rm -rf "$ROOTFS"' EXIT
echo "debootstrap $SUITE from $MIRROR"
$SUDO debootstrap --variant=minbase "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
    || { tail -20 "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"
$SUDO rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb
$SUDO tar -C "$ROOTFS" --numeric-owner -c . | "$PODMAN" import --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "imported $IMAGE"
