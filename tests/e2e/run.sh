#!/usr/bin/env bash
# `make e2e`: build (or reuse) containerd/ctr/shim, crictl, the nriprobe
# self-check plugin, install runc + busybox-static, then run the pytest e2e
# module against a private containerd with fracplugin attached over NRI.
#
# Env:
#   FRACPLUGIN_E2E_CACHE                 build cache (default /var/cache/fracplugin-e2e)
#   FRACPLUGIN_E2E_CONTAINERD_VERSIONS   space-separated (default "v2.3.7 v2.1.9": NRI v0.12 and v0.8)
#   CRICTL_VERSION                       default v1.37.0
#   PYTEST_ARGS                          extra pytest arguments
# Cleans up (pods, containerd, shims, runc containers, mounts, temp dirs) on
# any exit through harness.py's cleanup, even when pytest is killed.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${PY:-$repo/.venv/bin/python}"
export FRACPLUGIN_E2E_CONTAINERD_VERSIONS="${FRACPLUGIN_E2E_CONTAINERD_VERSIONS:-v2.3.7 v2.1.9}"
export FRACPLUGIN_E2E_REQUIRED=1

if [[ $(id -u) -ne 0 ]]; then
    echo "e2e: must run as root (starts containerd and runc)" >&2
    exit 1
fi
echo "e2e: cgroup filesystem: $(stat -fc %T /sys/fs/cgroup) (tmpfs = cgroup v1, cgroup2fs = v2)" >&2

cleanup() {
    local rc=$?
    "$py" "$here/harness.py" cleanup || true
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

t0=$(date +%s)
for v in $FRACPLUGIN_E2E_CONTAINERD_VERSIONS; do
    "$here/build.sh" "$v"
done
t1=$(date +%s)
echo "e2e: builds/cache check took $((t1 - t0))s" >&2

cd "$repo"
"$py" -m pytest "$here" -m e2e -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
    ${PYTEST_ARGS:-}
echo "e2e: tests took $(( $(date +%s) - t1 ))s" >&2
