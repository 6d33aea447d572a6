package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/google/nftables"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/component-base/logs"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/kube-network-policies/pkg/networkpolicy"
)

// tableName is the nftables table (family inet) the controller owns: networkpolicy.Config's
// default, named here so that --cleanup removes the same one.
const tableName = "kube-network-policies"

// runNetworkPolicies enforces the cluster's NetworkPolicies on this node with the controller of
// sigs.k8s.io/kube-network-policies (the enforcer kind ships): an nftables table whose
// postrouting chain sends the first packet of each new connection to or from a pod that a
// policy selects to an NFQUEUE, where the controller accepts or drops it by the policies. This
// is upstream's cmd/main.go with the node's kubeconfig instead of the in-cluster config (it
// runs beside the kubelet, not as a DaemonSet pod), without the alpha AdminNetworkPolicy APIs
// (no CRDs for them here), and stopping on SIGTERM as on SIGINT: the table goes with it, so a
// stopped controller leaves no queue that nothing reads.
//
//	kvpilot-controlplane kube-network-policies --kubeconfig F --hostname-override NODE [--nfqueue-id N]
//	kvpilot-controlplane kube-network-policies --cleanup   (remove a killed run's table, then exit)
func runNetworkPolicies(args []string) int {
	flags := flag.NewFlagSet("kube-network-policies", flag.ContinueOnError)
	kubeconfig := flags.String("kubeconfig", "", "the node's credentials for the API server (required)")
	hostname := flags.String("hostname-override", "", "the Node this runs on (default: the hostname)")
	queueID := flags.Int("nfqueue-id", 100, "the NFQUEUE the first packets go to")
	failOpen := flags.Bool("fail-open", false, "accept packets while nothing reads the queue")
	metrics := flags.String("metrics-bind-address", "127.0.0.1:9080", "host:port of /metrics")
	bug1766 := flags.Bool("netfilter-bug-1766-fix", true,
		"send DNS to the queue on the prerouting hook (conntrack race fixed in kernels 6.12+)")
	cleanup := flags.Bool("cleanup", false, "delete the nftables table and exit")
	logging := logsapi.NewLoggingConfiguration()
	logsapi.AddGoFlags(logging, flags)
	if err := flags.Parse(args); err != nil {
		return 2
	}
	if *cleanup {
		return cleanupNetworkPolicies()
	}
	logs.InitLogs()
	if err := logsapi.ValidateAndApply(logging, nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if _, _, err := net.SplitHostPort(*metrics); err != nil || *kubeconfig == "" {
		fmt.Fprintln(os.Stderr, "usage: kvpilot-controlplane kube-network-policies --kubeconfig F "+
			"[--hostname-override NODE] [--metrics-bind-address HOST:PORT]")
		return 2
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()

	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		klog.ErrorS(err, "reading the kubeconfig")
		return 1
	}
	// protobuf, as upstream: the pod informer is the controller's largest stream
	config.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	config.ContentType = "application/vnd.kubernetes.protobuf"
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		klog.ErrorS(err, "creating the client")
		return 1
	}
	factory := informers.NewSharedInformerFactory(client, 0)

	http.Handle("/metrics", promhttp.Handler())
	go func() { utilruntime.HandleError(http.ListenAndServe(*metrics, nil)) }()

	// NRI stays enabled, as upstream's main leaves it (disabled, v0.8.0 dereferences its nil
	// plugin for an IP no pod has): where the runtime has no NRI socket (containerd 1.6) the
	// plugin logs that it could not connect, and the pods' IPs come from the API server.
	controller, err := networkpolicy.NewController(client,
		factory.Networking().V1().NetworkPolicies(), factory.Core().V1().Namespaces(), factory.Core().V1().Pods(),
		nil, nil, nil, nil,
		networkpolicy.Config{FailOpen: *failOpen, QueueID: *queueID, NodeName: *hostname,
			NetfilterBug1766Fix: *bug1766, NFTableName: tableName})
	if err != nil {
		klog.ErrorS(err, "creating the network policy controller")
		return 1
	}
	done := make(chan error, 1)
	go func() { done <- controller.Run(ctx) }()
	factory.Start(ctx.Done())

	select {
	case err = <-done: // it gave up (no nfqueue socket, no nftables): say so and exit non-zero
		klog.ErrorS(err, "the network policy controller stopped")
		return 1
	case <-ctx.Done():
	}
	select { // Run deletes its table on the way out
	case <-done:
	case <-time.After(10 * time.Second):
		klog.Info("the controller did not stop within 10 s")
	}
	return cleanupNetworkPolicies()
}

// cleanupNetworkPolicies deletes the controller's nftables table if it is there (what a killed
// run leaves: a queue rule with no reader drops every new connection of the pods it selected).
func cleanupNetworkPolicies() int {
	conn, err := nftables.New()
	if err != nil {
		fmt.Fprintf(os.Stderr, "kube-network-policies --cleanup: %v\n", err)
		return 1
	}
	tables, err := conn.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kube-network-policies --cleanup: listing nftables tables: %v\n", err)
		return 1
	}
	for _, table := range tables {
		if table.Name == tableName {
			conn.DelTable(table)
			if err := conn.Flush(); err != nil {
				fmt.Fprintf(os.Stderr, "kube-network-policies --cleanup: deleting table %s: %v\n", tableName, err)
				return 1
			}
		}
	}
	return 0
}
