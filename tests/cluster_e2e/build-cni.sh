#!/usr/bin/env bash
# Build (or reuse) the reference CNI plugins the cluster e2e's pod network needs
# (bridge, host-local, loopback; github.com/containernetworking/plugins
# $CNI_PLUGINS_VERSION) with one `go install` (the module has no replace directives)
# into a temp dir renamed into the cache, so no half binary is ever cached.
# Run by tests/cluster_e2e/run.sh and by scripts/ci-prebuild.sh (stage cluster).
# Prints the plugins' directory on stdout; the rest goes to stderr.
#
# Env: FRACPLUGIN_E2E_CACHE (default /var/cache/fracplugin-e2e), CNI_PLUGINS_VERSION (v1.10.0)
set -euo pipefail
CNI_PLUGINS_VERSION="${CNI_PLUGINS_VERSION:-v1.10.0}"
cache="${FRACPLUGIN_E2E_CACHE:-/var/cache/fracplugin-e2e}"
cni_bin="$cache/cni-plugins-$CNI_PLUGINS_VERSION/bin"
mkdir -p "$cache"
exec 9>"$cache/.cni-plugins-build.lock"
flock 9
if [[ -x "$cni_bin/bridge" && -x "$cni_bin/host-local" && -x "$cni_bin/loopback" ]]; then
    echo "cluster-e2e: CNI plugins $CNI_PLUGINS_VERSION cached in $cni_bin" >&2
else
    c0=$(date +%s)
    tmp="$(mktemp -d "$cache/cni-plugins.build.XXXXXX")"
    m=github.com/containernetworking/plugins/plugins
    GOBIN="$tmp" GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false nice -n 10 go install -trimpath \
        "$m/main/bridge@$CNI_PLUGINS_VERSION" "$m/main/loopback@$CNI_PLUGINS_VERSION" \
        "$m/ipam/host-local@$CNI_PLUGINS_VERSION" >&2
    mkdir -p "$(dirname "$cni_bin")"; rm -rf "$cni_bin"; mv "$tmp" "$cni_bin"
    echo "cluster-e2e: CNI plugins $CNI_PLUGINS_VERSION built in $(( $(date +%s) - c0 ))s" >&2
fi
echo "$cni_bin"
