#!/usr/bin/env bash
# `make cluster-e2e` (issue 24): the shipped install (image + Helm chart) on a real
# one-node cluster on this machine: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet (each Kubernetes line of $FRACPLUGIN_KUBE_VERSIONS, one
# `go build` per line: tests/kubelet_e2e/build.sh), containerd + crictl
# (tests/e2e/build.sh), the reference CNI plugins bridge, host-local, loopback
# (github.com/containernetworking/plugins $CNI_PLUGINS_VERSION, one `go install`,
# cached: build-cni.sh), helm (scripts/chart-tools.sh)
# and the image archive of `make image` (run it first; .ci/run does).
# Everything started is stopped and removed on any exit (fullcluster.py cleanup:
# pods, containerd, kubelet's mounts, the bridge fpk8s0 and the DNAT rule).
#
# Env:
#   FRACPLUGIN_E2E_CACHE       build cache (default /var/cache/fracplugin-e2e)
#   FRACPLUGIN_KUBE_VERSIONS   Kubernetes lines, space-separated (default "v1.37.2 v1.35.4"), one
#                              cluster each, as make kubelet-e2e
#   CONTAINERD_VERSION         default v2.3.7
#   CNI_PLUGINS_VERSION        default v1.10.0
#   FRACPLUGIN_IMAGE_ARCHIVE   default build/image/fracplugin-0.1.0.oci.tar
#   PYTEST_ARGS                extra pytest arguments
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${PY:-$repo/.venv/bin/python}"
export FRACPLUGIN_KUBE_VERSIONS="${FRACPLUGIN_KUBE_VERSIONS:-v1.37.2 v1.35.4}"
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
KUBE_VERSIONS="$FRACPLUGIN_KUBE_VERSIONS" "$repo/tests/kubelet_e2e/build.sh"
cni_bin=$(CNI_PLUGINS_VERSION="$CNI_PLUGINS_VERSION" bash "$here/build-cni.sh")
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
