// Command kvpilot-controlplane is a Kubernetes control plane built from Go modules for
// kvpilot's tests: one binary, one component per process.
//
//	kvpilot-controlplane etcd --data-dir DIR --listen-client-url URL --listen-peer-url URL
//	kvpilot-controlplane kube-apiserver FLAGS...           (kube-apiserver's own flags)
//	kvpilot-controlplane kube-controller-manager FLAGS...
//	kvpilot-controlplane kube-scheduler FLAGS...
//	kvpilot-controlplane kubelet FLAGS...                  (a node agent: root, a CRI runtime)
//	kvpilot-controlplane kube-proxy FLAGS...               (Service IPs as iptables rules)
//	kvpilot-controlplane kube-network-policies FLAGS...    (NetworkPolicies enforced on the node)
//	kvpilot-controlplane cri-clean --endpoint unix:///S    (remove every pod sandbox of a runtime)
//	kvpilot-controlplane kubectl ARGS...                   (or through a link named kubectl)
//	kvpilot-controlplane helm ARGS...                      (Helm 4; or through a link named helm)
//	kvpilot-controlplane version
//
// kwok, which fakes nodes for tests, is its own module and binary (kwok/).
//
// Each component runs alone in its process, as in a real cluster, so global flags, feature
// gates and metrics registries never clash. The entry points are the ones the upstream
// binaries call (k8s.io/kubernetes/cmd/<component>/app), with the same blank imports.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// commands maps a component name to its entry point; each returns the process exit code.
var commands = map[string]func(args []string) int{
	"etcd":                    runEtcd,
	"kube-apiserver":          runAPIServer,
	"kube-controller-manager": runControllerManager,
	"kube-scheduler":          runScheduler,
	"kubelet":                 runKubelet,
	"kube-proxy":              runProxy,
	"kube-network-policies":   runNetworkPolicies,
	"kubectl":                 runKubectl,
	"helm":                    runHelm,
	"cri-clean":               runCRIClean,
	"version":                 runVersion,
}

func main() {
	name, args := filepath.Base(os.Args[0]), os.Args[1:]
	if _, ok := commands[name]; !ok { // not called through a link named for a component
		if len(args) == 0 {
			usage()
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	run, ok := commands[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "kvpilot-controlplane: unknown component %q\n", name)
		usage()
		os.Exit(2)
	}
	// The upstream commands read os.Args through cobra: show them their own argv.
	os.Args = append([]string{name}, args...)
	os.Exit(run(args))
}

func usage() {
	names := make([]string, 0, len(commands))
	for name := range commands {
		names = append(names, name)
	}
	sort.Strings(names)
	fmt.Fprintf(os.Stderr, "usage: kvpilot-controlplane {%s} [flags]\n", strings.Join(names, "|"))
}
