// Per-NRI-line shims for the shared runtime harness (main.go, a symlink to
// ../../../common/nri/runtime/main.go). NRI v0.12 has dedicated request types
// for pod and container lifecycle events (reference docs/reference/nri-protocol.md 1.7).
package main

import (
	"context"

	"github.com/containerd/nri/pkg/adaptation"
)

const (
	nriLine        = "v0.12"
	runtimeVersion = "v2.3.4-fracplugin-interop"
)

func evRunPod(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox) error {
	return a.RunPodSandbox(ctx, &adaptation.RunPodSandboxRequest{Pod: p})
}

func evStopPod(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox) error {
	return a.StopPodSandbox(ctx, &adaptation.StopPodSandboxRequest{Pod: p})
}

func evRemovePod(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox) error {
	return a.RemovePodSandbox(ctx, &adaptation.RemovePodSandboxRequest{Pod: p})
}

func evPostCreate(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox, c *adaptation.Container) error {
	return a.PostCreateContainer(ctx, &adaptation.PostCreateContainerRequest{Pod: p, Container: c})
}

func evStart(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox, c *adaptation.Container) error {
	return a.StartContainer(ctx, &adaptation.StartContainerRequest{Pod: p, Container: c})
}

func evPostStart(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox, c *adaptation.Container) error {
	return a.PostStartContainer(ctx, &adaptation.PostStartContainerRequest{Pod: p, Container: c})
}

func evRemoveContainer(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox, c *adaptation.Container) error {
	return a.RemoveContainer(ctx, &adaptation.RemoveContainerRequest{Pod: p, Container: c})
}
