// Command coredns is CoreDNS (github.com/coredns/coredns) with the plugins a cluster's DNS
// add-on runs (kubeadm's Corefile: errors, health/ready, kubernetes, forward, cache), built in a
// module of its own as kwok is, at the release whose client-go is the control plane's 0.34 line.
// It serves the tests' real node (tests/kube/node.py): Services and pods by name, the rest
// forwarded to the machine's resolver. Selecting plugins by setting dnsserver.Directives is
// CoreDNS's documented way to build with a chosen plugin set (plugin.cfg, "Compile Time
// Enabling or Disabling Plugins"); the order below is plugin.cfg's.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes", "loop", "forward"}
}

func main() { coremain.Run() }
