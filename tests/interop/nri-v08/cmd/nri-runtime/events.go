// Per-NRI-line shims for the shared runtime harness (main.go, a symlink to
// ../../../common/nri/runtime/main.go). NRI v0.8 relays pod and container
// lifecycle events as StateChange (reference docs/reference/nri-protocol.md 1.7).
package main

import (
	"context"

	"github.com/containerd/nri/pkg/adaptation"
)

const (
	nriLine        = "v0.8"
	runtimeVersion = "v2.1.9-fracplugin-interop"
)

func ev(p *adaptation.PodSandbox, c *adaptation.Container) *adaptation.StateChangeEvent {
	return &adaptation.StateChangeEvent{Pod: p, Container: c}
}

func evRunPod(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox) error {
	return a.RunPodSandbox(ctx, ev(p, nil))
}

func evStopPod(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox) error {
	return a.StopPodSandbox(ctx, ev(p, nil))
}

func evRemovePod(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox) error {
	return a.RemovePodSandbox(ctx, ev(p, nil))
}

func evPostCreate(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox, c *adaptation.Container) error {
	return a.PostCreateContainer(ctx, ev(p, c))
}

func evStart(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox, c *adaptation.Container) error {
	return a.StartContainer(ctx, ev(p, c))
}

func evPostStart(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox, c *adaptation.Container) error {
	return a.PostStartContainer(ctx, ev(p, c))
}

func evRemoveContainer(ctx context.Context, a *adaptation.Adaptation, p *adaptation.PodSandbox, c *adaptation.Container) error {
	return a.RemoveContainer(ctx, ev(p, c))
}
