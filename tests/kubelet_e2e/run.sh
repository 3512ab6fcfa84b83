#!/usr/bin/env bash
# `make kubelet-e2e`: build (or reuse) kubelet + kube-apiserver (each version in
# $FRACPLUGIN_KUBE_VERSIONS), etcd, containerd + crictl (tests/e2e/build.sh),
# then run tests/kubelet_e2e against a one-node cluster on this machine with
# fracplugin's both doors on. Everything is stopped and removed on any exit.
#
# Env:
#   FRACPLUGIN_E2E_CACHE       build cache (default /var/cache/fracplugin-e2e)
#   FRACPLUGIN_KUBE_VERSIONS   space-separated (default "v1.37.2 v1.35.4")
#   ETCD_VERSION               default v3.7.3
#   CONTAINERD_VERSION         default v2.3.7 (built by tests/e2e/build.sh)
#   FRACPLUGIN_KUBELET_E2E_MODULES  test modules (default: test_kubelet.py test_both_doors.py)
#   PYTEST_ARGS                extra pytest arguments
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${PY:-$repo/.venv/bin/python}"
export FRACPLUGIN_KUBE_VERSIONS="${FRACPLUGIN_KUBE_VERSIONS:-v1.37.2 v1.35.4}"
export CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.3.7}"
export FRACPLUGIN_E2E_REQUIRED=1

if [[ $(id -u) -ne 0 ]]; then
    echo "kubelet-e2e: must run as root (starts kubelet, containerd and runc)" >&2
    exit 1
fi
command -v go >/dev/null || { echo "kubelet-e2e: go not found (the builds need Go >= 1.26)" >&2; exit 1; }
echo "kubelet-e2e: cgroup filesystem: $(stat -fc %T /sys/fs/cgroup) (tmpfs = cgroup v1)" >&2

cleanup() {
    local rc=$?
    "$py" "$here/cluster.py" cleanup || true
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

t0=$(date +%s)
"$repo/tests/e2e/build.sh" "$CONTAINERD_VERSION"
KUBE_VERSIONS="$FRACPLUGIN_KUBE_VERSIONS" "$here/build.sh"
t1=$(date +%s)
echo "kubelet-e2e: builds/cache check took $((t1 - t0))s" >&2

cd "$repo"
modules=()
for m in ${FRACPLUGIN_KUBELET_E2E_MODULES:-test_kubelet.py test_both_doors.py}; do modules+=("$here/$m"); done
"$py" -m pytest "${modules[@]}" -m kubelet_e2e -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
    -W ignore::urllib3.exceptions.InsecureRequestWarning \
    ${PYTEST_ARGS:-}
echo "kubelet-e2e: tests took $(( $(date +%s) - t1 ))s" >&2
