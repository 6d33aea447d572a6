package main

import (
	"log/slog"
	"os"

	helmcmd "helm.sh/helm/v4/pkg/cmd"
	"helm.sh/helm/v4/pkg/kube"
)

// runHelm is cmd/helm's main (Helm 4, built against the server's client libraries).
func runHelm(args []string) int {
	kube.ManagedFieldsManager = "helm" // the field manager name server-side apply records
	command, err := helmcmd.NewRootCmd(os.Stdout, args, helmcmd.SetupLogging)
	if err != nil {
		slog.Warn("command failed", slog.Any("error", err))
		return 1
	}
	if err := command.Execute(); err != nil {
		if commandErr, ok := err.(helmcmd.CommandError); ok {
			return commandErr.ExitCode
		}
		return 1
	}
	return 0
}
