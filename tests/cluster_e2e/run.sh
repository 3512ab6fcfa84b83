#!/usr/bin/env bash
# `make cluster-e2e` (issue 24): the shipped install (image + Helm chart) on a real
# one-node cluster on this machine: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet (Kubernetes $CLUSTER_KUBE_VERSION, one `go build`:
# tests/kubelet_e2e/build.sh), containerd + crictl (tests/e2e/build.sh), the reference
# CNI plugins bridge, host-local, loopback (github.com/containernetworking/plugins
# $CNI_PLUGINS_VERSION, one `go install`, cached), helm (scripts/chart-tools.sh)
# and the image archive of `make image` (run it first; .ci/run does).
# Everything started is stopped and removed on any exit (fullcluster.py cleanup:
# pods, containerd, kubelet's mounts, the bridge fpk8s0 and the DNAT rule).
#
# Env:
#   FRACPLUGIN_E2E_CACHE       build cache (default /var/cache/fracplugin-e2e)
#   CLUSTER_KUBE_VERSION       default v1.37.2
#   CONTAINERD_VERSION         default v2.3.7
#   CNI_PLUGINS_VERSION        default v1.10.0
#   FRACPLUGIN_IMAGE_ARCHIVE   default build/image/fracplugin-0.1.0.oci.tar
#   PYTEST_ARGS                extra pytest arguments
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${PY:-$repo/.venv/bin/python}"
export CLUSTER_KUBE_VERSION="${CLUSTER_KUBE_VERSION:-v1.37.2}"
export FRACPLUGIN_KUBE_VERSIONS="$CLUSTER_KUBE_VERSION"
export CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.3.7}"
CNI_PLUGINS_VERSION="${CNI_PLUGINS_VERSION:-v1.10.0}"
export FRACPLUGIN_E2E_REQUIRED=1
archive="${FRACPLUGIN_IMAGE_ARCHIVE:-$repo/build/image/fracplugin-0.1.0.oci.tar}"
export FRACPLUGIN_IMAGE_ARCHIVE="$archive"

fail() { echo "cluster-e2e: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || fail "must run as root (kubelet, containerd, runc, iptables, a bridge)"
command -v go >/dev/null || fail "go not found (the builds need Go >= 1.26)"
command -v iptables >/dev/null || fail "iptables not found (apt-get install iptables): the kubernetes Service's DNAT rule"
[[ -f "$archive" ]] || fail "no image archive $archive: run \`make image\` first"

cleanup() {
    local rc=$?
    "$py" "$here/fullcluster.py" cleanup || true
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

t0=$(date +%s)
"$repo/tests/e2e/build.sh" "$CONTAINERD_VERSION"
KUBE_VERSIONS="$CLUSTER_KUBE_VERSION" "$repo/tests/kubelet_e2e/build.sh"
# The reference CNI plugins the pod network needs, one `go install` (the module has no
# replace directives), into a temp dir renamed into the cache (no half binary is ever cached).
cache="${FRACPLUGIN_E2E_CACHE:-/var/cache/fracplugin-e2e}"
cni_bin="$cache/cni-plugins-$CNI_PLUGINS_VERSION/bin"
if [[ -x "$cni_bin/bridge" && -x "$cni_bin/host-local" && -x "$cni_bin/loopback" ]]; then
    echo "cluster-e2e: CNI plugins $CNI_PLUGINS_VERSION cached in $cni_bin" >&2
else
    c0=$(date +%s)
    mkdir -p "$cache"
    tmp="$(mktemp -d "$cache/cni-plugins.build.XXXXXX")"
    m=github.com/containernetworking/plugins/plugins
    GOBIN="$tmp" GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false nice -n 10 go install -trimpath \
        "$m/main/bridge@$CNI_PLUGINS_VERSION" "$m/main/loopback@$CNI_PLUGINS_VERSION" \
        "$m/ipam/host-local@$CNI_PLUGINS_VERSION"
    mkdir -p "$(dirname "$cni_bin")"; rm -rf "$cni_bin"; mv "$tmp" "$cni_bin"
    echo "cluster-e2e: CNI plugins $CNI_PLUGINS_VERSION built in $(( $(date +%s) - c0 ))s" >&2
fi
export FRACPLUGIN_CNI_BIN="$cni_bin"
tools=$(bash "$repo/scripts/chart-tools.sh" helm)
eval "$tools"
export HELM
t1=$(date +%s)
echo "cluster-e2e: builds/cache check took $((t1 - t0))s; helm $("$HELM" version --short)" >&2

cd "$repo"
"$py" -m pytest "$here" -m cluster_e2e -q -p no:cacheprovider -o addopts="-ra --strict-markers" -s \
    ${PYTEST_ARGS:-}
echo "cluster-e2e: tests took $(( $(date +%s) - t1 ))s" >&2
