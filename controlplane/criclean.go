package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	remote "k8s.io/cri-client/pkg"
)

// runCRIClean stops and removes every pod sandbox (and so every container) of a CRI runtime,
// as `crictl rmp --force --all` does: what a node's test leaves behind after its kubelet has
// gone, or a killed run left in the runtime's store. With the sandboxes go their network
// namespaces and CNI addresses, which the runtime releases through the CNI DEL of each.
//
//	kvpilot-controlplane cri-clean --endpoint unix:///path/containerd.sock
func runCRIClean(args []string) int {
	flags := flag.NewFlagSet("cri-clean", flag.ContinueOnError)
	endpoint := flags.String("endpoint", "", "the CRI runtime's endpoint (unix:///...)")
	timeout := flags.Duration("timeout", 2*time.Minute, "give up after this long")
	if err := flags.Parse(args); err != nil || *endpoint == "" {
		fmt.Fprintln(os.Stderr, "usage: kvpilot-controlplane cri-clean --endpoint unix:///path/to.sock")
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	runtime, err := remote.NewRemoteRuntimeService(*endpoint, 10*time.Second, nil, nil)
	if err != nil {
		fmt.Fprintf(os.Stderr, "cri-clean: %v\n", err)
		return 1
	}
	sandboxes, err := runtime.ListPodSandbox(ctx, nil)
	if err != nil {
		fmt.Fprintf(os.Stderr, "cri-clean: listing pod sandboxes: %v\n", err)
		return 1
	}
	failed := 0
	for _, sandbox := range sandboxes {
		name := sandbox.GetMetadata().GetNamespace() + "/" + sandbox.GetMetadata().GetName()
		if err := runtime.StopPodSandbox(ctx, sandbox.GetId()); err != nil {
			fmt.Fprintf(os.Stderr, "cri-clean: stopping %s: %v\n", name, err)
		}
		if err := runtime.RemovePodSandbox(ctx, sandbox.GetId()); err != nil {
			fmt.Fprintf(os.Stderr, "cri-clean: removing %s: %v\n", name, err)
			failed++
			continue
		}
		fmt.Fprintf(os.Stdout, "removed pod sandbox %s (%s)\n", name, sandbox.GetId()[:12])
	}
	if failed > 0 {
		return 1
	}
	return 0
}
