package main

import (
	_ "k8s.io/client-go/plugin/pkg/client/auth" // client auth plugins, as cmd/kubectl
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	"k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"
)

// runKubectl is cmd/kubectl's main: kubectl at the server's own version.
func runKubectl(args []string) int {
	logs.GlogSetter(cmd.GetLogVerbosity(append([]string{"kubectl"}, args...))) //nolint:errcheck
	if err := cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()); err != nil {
		util.CheckErr(err) // prints the error and exits non-zero
	}
	return 0
}
