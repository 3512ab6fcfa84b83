#!/usr/bin/env bash
# Build the Go interop harnesses and run the interop pytest modules.
#
#   bash tests/interop/run.sh [pytest args...]      (what `make interop` calls)
#
# Go modules (go.sum committed; downloads go through the Go module proxy):
#   tests/interop/nri-v012  github.com/containerd/nri v0.12.5 (containerd 2.3)
#   tests/interop/nri-v08   github.com/containerd/nri v0.8.0  (containerd 1.7.26+/2.0/2.1)
#   tests/interop/kubelet   k8s.io/kubelet v0.37.2 (deviceplugin v1beta1)
# Binaries go to tests/interop/bin/<module>/ (gitignored); Go's build cache
# makes rebuilds cheap. A missing Go toolchain is a failure, not a skip.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
GO="$(command -v go || true)"
if [[ -z "$GO" && -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go; fi
if [[ -z "$GO" ]]; then
  echo "interop: Go toolchain not found; install Go >= 1.26 (the kubelet module needs it) and put it on PATH" >&2
  exit 1
fi
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=mod"
echo "interop: $("$GO" version)"
for m in nri-v012 nri-v08 kubelet; do
  t0=$(date +%s%N)
  (cd "$HERE/$m" && "$GO" build -o "$HERE/bin/$m/" ./cmd/...)
  echo "interop: built $m in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
done
PY="$REPO/.venv/bin/python"
[[ -x "$PY" ]] || PY=python3
cd "$REPO"
exec "$PY" -m pytest tests/interop -m interop -q "$@"
