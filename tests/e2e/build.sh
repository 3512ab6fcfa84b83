#!/usr/bin/env bash
# Build (or reuse) the e2e binaries: containerd + ctr + containerd-shim-runc-v2,
# and crictl, from their released Go modules through the module proxy, into a
# cache outside the repository.  Installs runc and busybox-static from Debian.
#
# Usage: tests/e2e/build.sh [containerd-version]      (default: $CONTAINERD_VERSION)
# Env:   FRACPLUGIN_E2E_CACHE (default /var/cache/fracplugin-e2e)
#        CONTAINERD_VERSION (default v2.3.7: latest 2.3.x on the proxy, NRI v0.12)
#        CRICTL_VERSION     (default v1.37.0; module sigs.k8s.io/cri-tools)
# Prints the build durations; skips a build whose binaries already exist.
set -euo pipefail

CACHE="${FRACPLUGIN_E2E_CACHE:-/var/cache/fracplugin-e2e}"
CONTAINERD_VERSION="${1:-${CONTAINERD_VERSION:-v2.3.7}}"
CRICTL_VERSION="${CRICTL_VERSION:-v1.37.0}"
CTRD_MOD=github.com/containerd/containerd/v2
CRICTL_MOD=sigs.k8s.io/cri-tools

log() { echo "[e2e-build $(date -u +%H:%M:%S)] $*" >&2; }

gobuild() {  # gobuild <bindir> <pkg@ver>...
    local bindir="$1"; shift
    mkdir -p "$bindir"
    # cgo off: no btrfs/devmapper graph drivers (they need C headers) and a
    # static shim, as containerd's own release build does for the shim.
    GOBIN="$bindir" GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local CGO_ENABLED=0 \
        nice -n 10 go install -trimpath -tags "no_btrfs no_devmapper no_zfs" "$@"
}

ctrd_bin="$CACHE/containerd-$CONTAINERD_VERSION/bin"
if [[ -x "$ctrd_bin/containerd" && -x "$ctrd_bin/ctr" && -x "$ctrd_bin/containerd-shim-runc-v2" ]]; then
    log "containerd $CONTAINERD_VERSION: cached in $ctrd_bin"
else
    log "building containerd $CONTAINERD_VERSION into $ctrd_bin"
    t0=$(date +%s)
    cmds=(cmd/containerd cmd/ctr cmd/containerd-shim-runc-v2)
    if grep -q '^exclude' "$(GOFLAGS=-mod=mod go mod download -json "$CTRD_MOD@$CONTAINERD_VERSION" \
            | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"; then
        # containerd 2.0/2.1 go.mod has exclude directives, which `go install
        # pkg@version` refuses; build the same released module source as the
        # main module instead (a writable copy of the module cache's tree).
        src="$CACHE/src/containerd-$CONTAINERD_VERSION"
        if [[ ! -d "$src" ]]; then
            dir=$(GOFLAGS=-mod=mod go mod download -json "$CTRD_MOD@$CONTAINERD_VERSION" \
                  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
            mkdir -p "$(dirname "$src")"
            cp -r "$dir" "$src.tmp" && chmod -R u+w "$src.tmp" && mv "$src.tmp" "$src"
        fi
        mkdir -p "$ctrd_bin"
        (cd "$src" && GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local CGO_ENABLED=0 \
            nice -n 10 go build -trimpath -tags "no_btrfs no_devmapper no_zfs" \
            -o "$ctrd_bin/" "${cmds[@]/#/./}")
    else
        pkgs=()
        for c in "${cmds[@]}"; do pkgs+=("$CTRD_MOD/$c@$CONTAINERD_VERSION"); done
        gobuild "$ctrd_bin" "${pkgs[@]}"
    fi
    log "containerd $CONTAINERD_VERSION built in $(( $(date +%s) - t0 ))s"
fi

crictl_bin="$CACHE/crictl-$CRICTL_VERSION/bin"
if [[ -x "$crictl_bin/crictl" ]]; then
    log "crictl $CRICTL_VERSION: cached in $crictl_bin"
else
    log "building crictl $CRICTL_VERSION into $crictl_bin"
    t0=$(date +%s)
    gobuild "$crictl_bin" "$CRICTL_MOD/cmd/crictl@$CRICTL_VERSION"
    log "crictl $CRICTL_VERSION built in $(( $(date +%s) - t0 ))s"
fi

# The harness's own self-check NRI plugin (tests/e2e/nriprobe, containerd/nri's
# Go stub): proves the runtime path independently of fracplugin.
probe_bin="$CACHE/nriprobe/bin"
probe_src="$(cd "$(dirname "$0")" && pwd)/nriprobe"
probe_sum=$(cat "$probe_src"/go.mod "$probe_src"/go.sum "$probe_src"/*.go | sha256sum | cut -c1-16)
if [[ -x "$probe_bin/nriprobe" && -f "$probe_bin/.src-$probe_sum" ]]; then
    log "nriprobe: cached in $probe_bin"
else
    log "building nriprobe into $probe_bin"
    t0=$(date +%s)
    mkdir -p "$probe_bin"
    rm -f "$probe_bin"/.src-*
    (cd "$probe_src" && GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local CGO_ENABLED=0 \
        nice -n 10 go build -trimpath -o "$probe_bin/nriprobe" .)
    touch "$probe_bin/.src-$probe_sum"
    log "nriprobe built in $(( $(date +%s) - t0 ))s"
fi

need_apt=()
command -v runc >/dev/null || need_apt+=(runc)
[[ -x /bin/busybox ]] || need_apt+=(busybox-static)
if ((${#need_apt[@]})); then
    log "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${need_apt[@]}" >/dev/null 2>&1 || {
        apt-get update >/dev/null && apt-get install -y --no-install-recommends "${need_apt[@]}" >/dev/null; }
fi
log "runc: $(runc --version | head -1); busybox: $(ls -l /bin/busybox)"
