package main

import (
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
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func runAPIServer(_ []string) int { return cli.Run(apiserver.NewAPIServerCommand()) }

func runControllerManager(_ []string) int {
	return cli.Run(controllermanager.NewControllerManagerCommand())
}

func runScheduler(_ []string) int { return cli.Run(scheduler.NewSchedulerCommand()) }

// runVersion prints the Kubernetes version compiled in (the one /version reports).
func runVersion(_ []string) int {
	fmt.Fprintln(os.Stdout, version.Get().GitVersion)
	return 0
}
