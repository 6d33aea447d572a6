#!/usr/bin/env bash
# What the tests' real node (tests/kube/node.py) runs on, from Debian where missing:
# containerd 1.6 (with its runc shim), runc, the CNI plugins, iptables and conntrack (kube-proxy).
set -euo pipefail
need=()
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
command -v iptables >/dev/null || need+=(iptables)
command -v conntrack >/dev/null || need+=(conntrack)
command -v ip >/dev/null || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
