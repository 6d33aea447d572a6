package main

import (
	"context"
	"fmt"
	"os"
	_ "time/tzdata" // CronJob time zones, as cmd/kube-apiserver and cmd/kube-controller-manager

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric
	"k8s.io/component-base/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func runAPIServer(_ []string) int { return cli.Run(apiserver.NewAPIServerCommand()) }

func runControllerManager(_ []string) int {
	return cli.Run(controllermanager.NewControllerManagerCommand())
}

func runScheduler(_ []string) int { return cli.Run(scheduler.NewSchedulerCommand()) }

// runKubelet runs the node agent (cmd/kubelet/kubelet.go); it needs root and a CRI runtime.
func runKubelet(_ []string) int { return cli.Run(kubelet.NewKubeletCommand(context.Background())) }

// runProxy runs kube-proxy (cmd/kube-proxy/proxy.go): Service virtual IPs as iptables rules.
func runProxy(_ []string) int { return cli.Run(proxy.NewProxyCommand()) }

// runVersion prints the Kubernetes version compiled in (the one /version reports).
func runVersion(_ []string) int {
	fmt.Fprintln(os.Stdout, version.Get().GitVersion)
	return 0
}
