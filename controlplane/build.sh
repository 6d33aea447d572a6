#!/usr/bin/env bash
# Builds kvpilot-controlplane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# the kubelet, kube-proxy, kube-network-policies, kubectl, helm), kwok and CoreDNS (modules of
# their own, kwok/ and coredns/) once per source state, into a cache outside the work tree, and
# prints the control plane binary's path.
#
#   $KVPILOT_CACHE/controlplane/bin/<hash>/{kvpilot-controlplane,kwok,coredns,kubectl,helm}
#                                   (hash of the three modules' go.mod, go.sum and *.go, the *.patch
#                                   files and go version)
#   $KVPILOT_CACHE/controlplane/{gomod,gocache}                    (GOMODCACHE, GOCACHE: shared between hashes)
#
# KVPILOT_CACHE defaults to ~/.cache/kvpilot. A second run with the same sources returns at
# once; a changed source rebuilds only what changed (Go's build cache). Beside the binary it
# links `kubectl` and `helm`, so putting that folder on PATH gives both at the server's version.
# Usage: controlplane/build.sh            (progress on stderr, the binary's path on stdout)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then
    PATH="/usr/local/go/bin:$PATH"  # the official tarball's place, when no profile put it on PATH
fi
command -v go >/dev/null 2>&1 || { echo "build.sh: Go 1.24+ is needed (https://go.dev/dl)" >&2; exit 1; }
cache="${KVPILOT_CACHE:-$HOME/.cache/kvpilot}/controlplane"
export GOTOOLCHAIN=local GOFLAGS="-trimpath -mod=readonly" CGO_ENABLED=0
export GOMODCACHE="$cache/gomod" GOCACHE="$cache/gocache"
hash="$( (go version; cd "$here" && cat build.sh go.mod go.sum ./*.go ./*.patch kwok/go.mod kwok/go.sum kwok/*.go \
    coredns/go.mod coredns/go.sum coredns/*.go) | sha256sum | cut -c1-16)"
out="$cache/bin/$hash"

# The version stamps that Kubernetes' and Helm's own release builds set with -X (hack/lib/version.sh,
# Helm's Makefile), read from go.mod: /version, `kubectl version` and Helm's
# .Capabilities.KubeVersion report v1.34.x instead of v0.0.0-master.
version_flags() {
    local kube helm minor
    kube="$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
    helm="$(cd "$here" && go list -m -f '{{.Version}}' helm.sh/helm/v4)"
    minor="$(echo "$kube" | cut -d. -f2)"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        printf -- ' -X %s.gitVersion=%s -X %s.gitMajor=1 -X %s.gitMinor=%s -X %s.gitTreeState=clean' \
            "$pkg" "$kube" "$pkg" "$pkg" "$minor" "$pkg"
    done
    printf -- ' -X helm.sh/helm/v4/internal/version.version=%s' "$helm"
    printf -- ' -X helm.sh/helm/v4/internal/version.kubeClientVersionMajor=1'
    printf -- ' -X helm.sh/helm/v4/internal/version.kubeClientVersionMinor=%s' "$minor"
    for pkg in pkg/chart/common pkg/chart/v2/lint/rules pkg/internal/v3/lint/rules; do
        printf -- ' -X helm.sh/helm/v4/%s.k8sVersionMajor=1 -X helm.sh/helm/v4/%s.k8sVersionMinor=%s' "$pkg" "$pkg" "$minor"
    done
}
# kube-network-policies v0.8.0 with kube-network-policies-xt-queue.patch applied: a patched copy
# of the module beside the binary and a go.mod that replaces the module with it, used through
# -modfile (the repository's go.mod names upstream's module, the module cache stays as
# downloaded; Go refuses -overlay for files there). Prints that go.mod's path.
patched_modfile() {
    local module=sigs.k8s.io/kube-network-policies dir="$out/src" src
    (cd "$here" && go mod download "$module")
    src="$(cd "$here" && go list -m -f '{{.Dir}}' "$module")"
    rm -rf "$dir" && mkdir -p "$dir"
    cp -r "$src" "$dir/kube-network-policies" && chmod -R u+w "$dir/kube-network-policies"
    (cd "$dir/kube-network-policies" && git apply "$here/kube-network-policies-xt-queue.patch")
    cp "$here/go.mod" "$here/go.sum" "$dir/"
    go mod edit -replace="$module=$dir/kube-network-policies" "$dir/go.mod"
    echo "$dir/go.mod"
}
if [ ! -x "$out/kvpilot-controlplane" ]; then
    echo "building kvpilot-controlplane into $out (cold: tens of minutes on 2 cores)" >&2
    mkdir -p "$out"
    start=$(date +%s)
    modfile="$(patched_modfile)"
    (cd "$here" && nice -n "${KVPILOT_BUILD_NICE:-10}" go build -modfile="$modfile" -ldflags="-s -w $(version_flags)" \
        -o "$out/kvpilot-controlplane.tmp" .)
    (cd "$here/kwok" && nice -n "${KVPILOT_BUILD_NICE:-10}" go build -ldflags="-s -w" -o "$out/kwok" .)
    (cd "$here/coredns" && nice -n "${KVPILOT_BUILD_NICE:-10}" go build -ldflags="-s -w" -o "$out/coredns" .)
    ln -sf kvpilot-controlplane "$out/kubectl"
    ln -sf kvpilot-controlplane "$out/helm"
    mv "$out/kvpilot-controlplane.tmp" "$out/kvpilot-controlplane"  # last: its presence marks a complete build
    echo "built kvpilot-controlplane in $(( $(date +%s) - start )) s ($(uptime | sed 's/.*load/load/'))" >&2
fi
echo "$out/kvpilot-controlplane"
