package main

import (
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"syscall"

	"go.etcd.io/etcd/server/v3/embed"
)

// runEtcd runs a one-member etcd embedded from go.etcd.io/etcd/server/v3/embed, at the
// version Kubernetes' own go.mod pulls in. --unsafe-no-fsync (tests) skips fsync, as
// `etcd --unsafe-no-fsync` does. It stops cleanly on SIGTERM or SIGINT.
func runEtcd(args []string) int {
	flags := flag.NewFlagSet("etcd", flag.ContinueOnError)
	dataDir := flags.String("data-dir", "", "directory for etcd's data (required)")
	clientURL := flags.String("listen-client-url", "http://127.0.0.1:2379", "client URL")
	peerURL := flags.String("listen-peer-url", "http://127.0.0.1:2380", "peer URL")
	noFsync := flags.Bool("unsafe-no-fsync", false, "skip fsync (tests only: data may be lost)")
	logLevel := flags.String("log-level", "warn", "debug, info, warn or error")
	if err := flags.Parse(args); err != nil {
		return 2
	}
	if *dataDir == "" {
		fmt.Fprintln(os.Stderr, "etcd: --data-dir is required")
		return 2
	}
	cfg := embed.NewConfig()
	cfg.Dir = *dataDir
	cfg.LogLevel = *logLevel
	cfg.UnsafeNoFsync = *noFsync
	client, err := url.Parse(*clientURL)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: --listen-client-url: %v\n", err)
		return 2
	}
	peer, err := url.Parse(*peerURL)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: --listen-peer-url: %v\n", err)
		return 2
	}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*client}, []url.URL{*client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*peer}, []url.URL{*peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	server, err := embed.StartEtcd(cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: %v\n", err)
		return 1
	}
	defer server.Close()
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-server.Server.ReadyNotify():
		fmt.Fprintf(os.Stderr, "etcd: ready on %s\n", client)
	case <-stop:
		return 0
	}
	select {
	case err := <-server.Err():
		fmt.Fprintf(os.Stderr, "etcd: %v\n", err)
		return 1
	case <-stop:
		return 0
	}
}
