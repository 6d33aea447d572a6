#!/usr/bin/env bash
# Installs what `make images` and tests/images need, idempotently, from Debian's packages:
# podman with runc (crun fails where the host's cgroups are in hybrid mode), slirp4netns (a
# test container reaches the host's loopback through it), debootstrap (the base image), and
# docker-registry (the CNCF distribution registry that tests/images pushes to).
set -euo pipefail
missing=()
for tool in podman runc slirp4netns debootstrap docker-registry; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    podman runc slirp4netns debootstrap docker-registry uidmap >/dev/null
echo "installed $(podman --version), $(runc --version | head -1)"
