#!/usr/bin/env bash
# Build (or reuse) the kubelet e2e binaries from released Go modules through the
# module proxy, into a cache outside the repository (like tests/e2e/build.sh):
#   kubelet + kube-apiserver + kube-controller-manager + kube-scheduler
#                             from k8s.io/kubernetes  $KUBE_VERSIONS (v1.37.2 v1.35.4),
#                             one `go build` per line so their shared packages compile once
#                             (the last two for the cluster e2e, tests/cluster_e2e)
#   etcd                      from go.etcd.io/etcd/server/v3 $ETCD_VERSION (v3.7.3)
#
# `go install pkg@version` refuses both modules: their go.mod files carry replace
# directives (k8s.io/* => ./staging/..., go.etcd.io/etcd/* => ../...).  So each is
# built from a scratch module that requires the released module and pins every
# replaced module to its released build (k8s.io/<staging> v0.<minor>.<patch>;
# etcd's siblings at the same v3 version).  The sample-* staging modules are not
# served by the proxy and no binary we build imports them.
#
# Env: FRACPLUGIN_E2E_CACHE (default /var/cache/fracplugin-e2e)
#      KUBE_VERSIONS ("v1.37.2 v1.35.4"; "" builds etcd only), ETCD_VERSION (v3.7.3)
# One build at a time (flock on $CACHE/.kubelet-e2e-build.lock): two runs would
# write the same scratch module.
# Prints the build durations; skips a build whose binaries already exist.
set -euo pipefail

CACHE="${FRACPLUGIN_E2E_CACHE:-/var/cache/fracplugin-e2e}"
KUBE_VERSIONS="${KUBE_VERSIONS-v1.37.2 v1.35.4}"  # set but empty: etcd only
ETCD_VERSION="${ETCD_VERSION:-v3.7.3}"
# Binaries of each line: kubelet + kube-apiserver (what kubelet-e2e, kai-e2e and the
# admission e2e run) and, for the cluster e2e (issue 24, tests/cluster_e2e, both lines),
# kube-controller-manager + kube-scheduler in the same `go build`, so their shared
# packages (client-go, apiserver, the API types) compile once. The cache check
# requires all four: a line cached before with two is rebuilt once (relinks from Go's
# build cache). $KUBE_BINARIES, when set, names the binaries of every line.
binaries_of() {  # binaries_of <version>
    echo "${KUBE_BINARIES:-kubelet kube-apiserver kube-controller-manager kube-scheduler}"
}

log() { echo "[kubelet-e2e-build $(date -u +%H:%M:%S)] $*" >&2; }

scratch_build() {  # scratch_build <srcdir> <bindir> <go.mod body> <pkg>...
    local src="$1" bindir="$2" body="$3"; shift 3
    mkdir -p "$src" "$bindir"
    printf 'module fracplugin.io/e2e-scratch\n\ngo 1.26.0\n\n%s\n' "$body" > "$src/go.mod"
    # An importing file keeps the requirement when go resolves the module graph.
    { echo "//go:build tools"; echo; echo "package scratch"; echo; echo "import ("
      for p in "$@"; do echo "	_ \"$p\""; done; echo ")"; } > "$src/tools.go"
    (cd "$src" && GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local CGO_ENABLED=0 \
        nice -n 10 go build -trimpath -tags tools -ldflags "${SCRATCH_LDFLAGS:-}" -o "$bindir/" "$@")
}

mkdir -p "$CACHE"
exec 9>"$CACHE/.kubelet-e2e-build.lock"
flock 9

etcd_bin="$CACHE/etcd-$ETCD_VERSION/bin"
if [[ -x "$etcd_bin/etcd" ]]; then
    log "etcd $ETCD_VERSION: cached in $etcd_bin"
else
    log "building etcd $ETCD_VERSION into $etcd_bin"
    t0=$(date +%s)
    body="require go.etcd.io/etcd/server/v3 $ETCD_VERSION"$'\n\nreplace (\n'
    for m in go.etcd.io/etcd/api/v3 go.etcd.io/etcd/client/pkg/v3 go.etcd.io/etcd/client/v3 go.etcd.io/etcd/pkg/v3; do
        body+="	$m => $m $ETCD_VERSION"$'\n'
    done
    body+=")"
    scratch_build "$CACHE/src/etcd-$ETCD_VERSION" "$etcd_bin" "$body" go.etcd.io/etcd/server/v3
    # go names the binary after the import path without its major version: "server"
    for n in server v3; do if [[ -x "$etcd_bin/$n" ]]; then mv "$etcd_bin/$n" "$etcd_bin/etcd"; fi; done
    log "etcd $ETCD_VERSION built in $(( $(date +%s) - t0 ))s"
fi

for kv in $KUBE_VERSIONS; do
    bin="$CACHE/kubernetes-$kv/bin"
    bins="$(binaries_of "$kv")"
    have=1
    for b in $bins; do [[ -x "$bin/$b" ]] || have=0; done
    if [[ $have == 1 ]]; then
        log "kubernetes $kv: cached in $bin"; continue
    fi
    log "building $bins $kv into $bin"
    t0=$(date +%s)
    gomod=$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$kv" \
            | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
    staging_ver="v0.${kv#v1.}"
    body="require k8s.io/kubernetes $kv"$'\n\nreplace (\n'
    for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod"); do
        [[ "$m" == k8s.io/sample-* ]] && continue
        body+="	$m => $m $staging_ver"$'\n'
    done
    body+=")"
    # One go build for every binary of the line: the packages they share
    # (client-go, apimachinery, the api types) compile once.
    pkgs=()
    for b in $bins; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
    # Into a temp dir, then renamed: a build killed while linking or writing
    # never leaves a half binary that the cache check above would take.
    tmp="$(mktemp -d "$CACHE/kubernetes-$kv.build.XXXXXX")"
    # The version the binaries report (what `make` in kubernetes' own tree stamps): without
    # it the API server says v0.0.0-master and `helm install` refuses the chart's kubeVersion.
    minor="${kv#v1.}"; minor="${minor%%.*}"
    ldf=""
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldf+=" -X $p.gitVersion=$kv -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
    done
    SCRATCH_LDFLAGS="$ldf" scratch_build "$CACHE/src/kubernetes-$kv" "$tmp" "$body" "${pkgs[@]}"
    mkdir -p "$bin"
    for b in $bins; do mv -f "$tmp/$b" "$bin/$b"; done
    rm -rf "$tmp"
    log "kubernetes $kv built in $(( $(date +%s) - t0 ))s"
done
