// nriprobe is the e2e harness's own self-check NRI plugin (not the subject
// under test). Built on containerd/nri's Go stub, it proves that the
// containerd + runc + crictl + image + NRI path works on this machine
// independently of fracplugin: for a pod annotated
// "fracplugin.test/probe: <value>" it adds env FP_PROBE=<value> and a bind
// mount of -mount-src at /tmp/fp-probe; for a pod annotated
// "fracplugin.test/probe-reject" it fails CreateContainer.
//
// Concurrency model: the stub's ttrpc server goroutines; handlers are
// stateless.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
)

type probe struct{ mountSrc string }

func (p *probe) CreateContainer(_ context.Context, pod *api.PodSandbox, c *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	fmt.Printf("CreateContainer pod=%s/%s container=%s\n", pod.GetNamespace(), pod.GetName(), c.GetName())
	if _, ok := pod.GetAnnotations()["fracplugin.test/probe-reject"]; ok {
		return nil, nil, errors.New("nriprobe: rejected by annotation fracplugin.test/probe-reject")
	}
	v, ok := pod.GetAnnotations()["fracplugin.test/probe"]
	if !ok {
		return nil, nil, nil
	}
	adj := &api.ContainerAdjustment{}
	adj.AddEnv("FP_PROBE", v)
	adj.AddMount(&api.Mount{Source: p.mountSrc, Destination: "/tmp/fp-probe", Type: "bind",
		Options: []string{"rbind", "rw"}})
	return adj, nil, nil
}

func main() {
	sock := flag.String("socket", "", "NRI socket path")
	src := flag.String("mount-src", "/tmp", "host directory bind-mounted at /tmp/fp-probe")
	flag.Parse()
	s, err := stub.New(&probe{mountSrc: *src}, stub.WithSocketPath(*sock),
		stub.WithPluginName("nriprobe"), stub.WithPluginIdx("50"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "nriprobe:", err)
		os.Exit(1)
	}
	if err := s.Run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "nriprobe: exited:", err)
		os.Exit(1)
	}
}
