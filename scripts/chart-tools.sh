#!/usr/bin/env bash
# Build (or reuse) the Go tools `make chart` and `make actionlint` need and print their paths.
#
#   bash scripts/chart-tools.sh            -> prints "HELM=<path>", "PROMTOOL=<path>" and "ACTIONLINT=<path>"
#   bash scripts/chart-tools.sh <tool>     -> only that one (helm, promtool, actionlint)
#
# Both are built from their released Go modules through the Go module proxy
# (no binary downloads), with `go install <pkg>@<version>`:
#   helm      helm.sh/helm/<major>/cmd/helm                  HELM_VERSION (v3.22.0; for v4.3.x set HELM_VERSION, not tried here)
#   promtool  github.com/prometheus/prometheus/cmd/promtool  PROMTOOL_MODULE_VERSION
#             (v0.316.0 = Prometheus 3.16.0; Prometheus tags its Go module v0.3xx.y for release 3.xx.y)
#   actionlint  github.com/rhysd/actionlint/cmd/actionlint   ACTIONLINT_VERSION (v1.7.12; checks .github/workflows)
# Cache: $FRACPLUGIN_TOOLS_CACHE (default $FRACPLUGIN_E2E_CACHE/chart-tools, that is
# /var/cache/fracplugin-e2e/chart-tools: the e2e builds' cache variable moves it too),
# one directory per tool and version, like the containerd/kubernetes builds of
# the e2e suites. A present binary is reused; a missing Go toolchain is a failure.
# Cold build times are recorded in docs/helm.md.
set -euo pipefail
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
PROMTOOL_MODULE_VERSION="${PROMTOOL_MODULE_VERSION:-v0.316.0}"
ACTIONLINT_VERSION="${ACTIONLINT_VERSION:-v1.7.12}"
CACHE="${FRACPLUGIN_TOOLS_CACHE:-${FRACPLUGIN_E2E_CACHE:-/var/cache/fracplugin-e2e}/chart-tools}"
HELM_MAJOR="${HELM_VERSION%%.*}"           # v3 or v4: the module path carries the major version
HELM_PKG="helm.sh/helm/$HELM_MAJOR/cmd/helm"
GO="$(command -v go || true)"
if [[ -z "$GO" && -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go; fi
if [[ -z "$GO" ]]; then
  echo "chart-tools: Go toolchain not found; install Go >= 1.26.7 (prometheus $PROMTOOL_MODULE_VERSION needs it)" >&2
  exit 1
fi
export GOTOOLCHAIN=local
export GOFLAGS="-buildvcs=false"
export CGO_ENABLED=0

build() {  # build <name> <package> <version> [ldflags]
  local name=$1 pkg=$2 version=$3 ldflags=${4:-}
  local dir="$CACHE/$name-$version/bin"
  if [[ ! -x "$dir/$name" ]]; then
    mkdir -p "$dir"
    local t0; t0=$(date +%s)
    echo "chart-tools: building $name from $pkg@$version (cold: minutes)" >&2
    # Build into a temp dir and rename: a killed build never leaves a half binary.
    local tmp; tmp="$(mktemp -d "$dir/.build.XXXXXX")"
    GOBIN="$tmp" nice "$GO" install -trimpath -ldflags "$ldflags" "$pkg@$version"
    mv -f "$tmp/$name" "$dir/$name"
    rmdir "$tmp"
    echo "chart-tools: built $name $version in $(( $(date +%s) - t0 ))s" >&2
  fi
  echo "$dir/$name"
}

# helm's release builds (its Makefile) stamp the version and the Kubernetes
# version it renders for without a cluster (client-go v0.X -> Kubernetes 1.X);
# without them `helm template` assumes Kubernetes 1.20 and refuses the chart's
# kubeVersion ">=1.30.0-0".
helm_ldflags() {
  local dir gomod k8s minor
  dir="$("$GO" mod download -json "helm.sh/helm/$HELM_MAJOR@$HELM_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  gomod="$dir/go.mod"
  k8s="$(awk '$1 == "k8s.io/client-go" {print $2}' "$gomod")"
  minor="$(echo "$k8s" | cut -d. -f2)"
  [[ -n "$minor" ]] || { echo "chart-tools: no k8s.io/client-go version in $gomod" >&2; exit 1; }
  local v="helm.sh/helm/$HELM_MAJOR"
  echo "-X $v/internal/version.version=$HELM_VERSION -X $v/pkg/chartutil.k8sVersionMajor=1 -X $v/pkg/chartutil.k8sVersionMinor=$minor -X $v/pkg/lint/rules.k8sVersionMajor=1 -X $v/pkg/lint/rules.k8sVersionMinor=$minor"
}

# actionlint's release builds stamp its version the same way (its Makefile).
actionlint() {
  echo "ACTIONLINT=$(build actionlint github.com/rhysd/actionlint/cmd/actionlint "$ACTIONLINT_VERSION" \
    "-X github.com/rhysd/actionlint.version=$ACTIONLINT_VERSION")"
}

case "${1:-all}" in
  helm)     echo "HELM=$(build helm "$HELM_PKG" "$HELM_VERSION" "$(helm_ldflags)")" ;;
  promtool) echo "PROMTOOL=$(build promtool github.com/prometheus/prometheus/cmd/promtool "$PROMTOOL_MODULE_VERSION")" ;;
  actionlint) actionlint ;;
  all)
    echo "HELM=$(build helm "$HELM_PKG" "$HELM_VERSION" "$(helm_ldflags)")"
    echo "PROMTOOL=$(build promtool github.com/prometheus/prometheus/cmd/promtool "$PROMTOOL_MODULE_VERSION")"
    actionlint ;;
  *) echo "usage: $0 [helm|promtool|actionlint|all]" >&2; exit 2 ;;
esac
