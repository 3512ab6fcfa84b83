#!/usr/bin/env bash
# Build, ahead of time, what the later steps of .ci/run build on first use, so
# that the cold builds run beside `make test` instead of after it.
#
#   bash scripts/ci-prebuild.sh go    <marker-dir>   the Go builds, one after another
#   bash scripts/ci-prebuild.sh image <marker-dir>   make image, amd64 + arm64 (Debian
#                                                     downloads and dpkg; the arm64 half
#                                                     under qemu: ~6.5 min of CPU cold)
#
# Each stage runs the very script its make target runs (each skips what is
# already cached: /var/cache/fracplugin-e2e, Go's caches, build/image), then
# touches <marker-dir>/<stage>.done; .ci/run waits for a stage's marker before
# the step that needs it. A failing stage writes <marker-dir>/<lane>.failed and
# the lane stops: the step that needs it fails with this lane's log.
#
# Why: on a new 2-core machine the Go builds (helm, promtool, containerd twice,
# crictl, etcd, two Kubernetes lines, the interop and celeval programs, the CNI plugins) are most
# of a cold .ci/run, and `make test` keeps about one core busy (docs/e2e.md:
# cold .ci/run). Builds run at nice 10 (the build scripts' own setting), so the
# tests keep the CPU they ask for; the tests wait on conditions, never on a
# wall-clock budget, which is what lets them share the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
lane="${1:?lane: go or image}"
markers="${2:?marker directory}"
mkdir -p "$markers"

stage() {  # stage <name> <command...>
    local name=$1; shift
    local t0; t0=$(date +%s)
    echo "ci-prebuild: $name: start $(date -u +%H:%M:%S)"
    if ! "$@"; then
        echo "ci-prebuild: $name: FAILED after $(( $(date +%s) - t0 ))s"
        echo "$name" > "$markers/$lane.failed"
        exit 1
    fi
    echo "ci-prebuild: $name: done in $(( $(date +%s) - t0 ))s"
    touch "$markers/$name.done"
}

go_modules() {  # the interop harnesses, as tests/interop/run.sh builds them
    local m
    for m in nri-v012 nri-v08 kubelet; do
        (cd tests/interop/$m && GOTOOLCHAIN=local GOFLAGS=-mod=mod nice -n 10 go build -o ../bin/$m/ ./cmd/...)
    done
}

celeval() {  # the admission e2e's CEL program, as tests/admission_e2e/conftest.py builds it
    mkdir -p build
    (cd tests/admission_e2e/celeval && GOTOOLCHAIN=local GOFLAGS=-mod=mod nice -n 10 go build -o ../../../build/celeval .)
}

e2e_binaries() {
    local v
    for v in ${FRACPLUGIN_E2E_CONTAINERD_VERSIONS:-v2.3.7 v2.1.9}; do bash tests/e2e/build.sh "$v"; done
}

kube_binaries() {  # every line's kubelet, kube-apiserver, kube-controller-manager, kube-scheduler
    KUBE_VERSIONS="${FRACPLUGIN_KUBE_VERSIONS:-v1.37.2 v1.35.4}" bash tests/kubelet_e2e/build.sh
}

cluster_binaries() {  # what make cluster-e2e needs beyond the kubelet stage (helm: stage chart-tools)
    bash tests/cluster_e2e/build-cni.sh >/dev/null
}

case "$lane" in
    go)
        # In the order .ci/run's steps need them.
        stage chart-tools bash -c 'bash scripts/chart-tools.sh >/dev/null'
        stage interop go_modules
        stage e2e e2e_binaries
        stage kubelet kube_binaries
        stage cluster cluster_binaries
        stage admission celeval
        ;;
    image)
        stage image bash scripts/build-image.sh
        ;;
    *)
        echo "ci-prebuild: unknown lane $lane (go or image)" >&2
        exit 2
        ;;
esac
