#!/usr/bin/env bash
# make image: build the fracplugin image from the project's own Dockerfile
# without an image registry (ADR 0027, docs/e2e.md "make image").
#
#   1. two base root filesystems from Debian packages (mmdebstrap, Debian's
#      python3.11): the final base (essential packages + python3.11; no apt, no
#      compiler, no pip) and the builder base (apt + python3.11 + ca-certificates);
#   2. uv, the version the Dockerfile's UV_IMAGE default names, from its wheel on
#      PyPI (a package registry), as a one-file image;
#   3. the three imported into a private store of buildah (daemonless; runc);
#   4. `buildah bud` of the repository's Dockerfile with BASE, BUILD_BASE,
#      UV_IMAGE and PYTHON_SOURCE=system, network only for apt and PyPI;
#   5. the image written as an OCI archive; its path is the last line printed.
#
# Needs root, mmdebstrap, buildah and runc (.ci/run installs them with apt-get).
# Env: FRACPLUGIN_IMAGE_SUITE (bookworm), FRACPLUGIN_IMAGE_MIRROR
# (http://deb.debian.org/debian), FRACPLUGIN_IMAGE_DIR (build/image).
# Cached: the base tarballs and the uv wheel (delete build/image for a cold build).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "make image: $*" >&2; exit 1; }
log() { echo "make image: $* ($(date -u +%H:%M:%S))" >&2; }

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap builds the root filesystem as root; buildah's store is root's)"
for tool in mmdebstrap buildah runc; do
  command -v "$tool" >/dev/null || die "$tool not found: apt-get install -y mmdebstrap buildah runc"
done

# pip of the host (to fetch uv's wheel): the project's python3.11, as .ci/run requires.
HOST_PYTHON=$(command -v python3.11 || command -v python3 || true)
[ -n "$HOST_PYTHON" ] && "$HOST_PYTHON" -m pip --version >/dev/null 2>&1 \
  || die "no python3.11 (or python3) with pip on PATH: it downloads uv's wheel from PyPI"
SUITE=${FRACPLUGIN_IMAGE_SUITE:-bookworm}
MIRROR=${FRACPLUGIN_IMAGE_MIRROR:-http://deb.debian.org/debian}
OUT=$(mkdir -p "${FRACPLUGIN_IMAGE_DIR:-build/image}" && cd "${FRACPLUGIN_IMAGE_DIR:-build/image}" && pwd)
PYTHON_VERSION=$(sed -n 's/^ARG PYTHON_VERSION=//p' Dockerfile)
UV_IMAGE_DEFAULT=$(sed -n 's/^ARG UV_IMAGE=//p' Dockerfile)
UV_VERSION=${UV_IMAGE_DEFAULT##*:}
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
[ -n "$PYTHON_VERSION" ] && [ -n "$UV_VERSION" ] && [ -n "$VERSION" ] \
  || die "could not read PYTHON_VERSION / UV_IMAGE from Dockerfile or version from pyproject.toml"

# A private store: nothing of the host's containers/storage is read or changed.
STORE=(--root "$OUT/store" --runroot "$OUT/run" --storage-driver overlay)
BASE=localhost/fracplugin-base:$SUITE-python$PYTHON_VERSION
BUILD_BASE=localhost/fracplugin-build-base:$SUITE-python$PYTHON_VERSION
UV_IMAGE=localhost/fracplugin-uv:$UV_VERSION
TAG=localhost/fracplugin:$VERSION
ARCHIVE=$OUT/fracplugin-$VERSION.oci.tar
start=$(date +%s)

# Leave out of every root filesystem what a daemon never reads.
SLIM=(--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias')

# 1. base root filesystems (mmdebstrap removes apt's package lists and caches by default).
if [ ! -s "$OUT/base-$SUITE.tar" ]; then
  # libstdc++6: grpcio's native module (the kubelet door, ADR 0021) links it;
  # the essential variant does not carry it (image-test imports every module).
  log "final base: mmdebstrap --variant=essential $SUITE + python$PYTHON_VERSION libstdc++6"
  mmdebstrap --quiet --format=tar --variant=essential --include="python$PYTHON_VERSION,libstdc++6" "${SLIM[@]}" \
    "$SUITE" "$OUT/base-$SUITE.tar.part" "$MIRROR"
  # The essential variant has no apt, but mmdebstrap's cleanup leaves apt's
  # state directories (the lists lock, lists/partial) in the tarball, after
  # any hook: drop them from the archive itself.
  tar --delete -f "$OUT/base-$SUITE.tar.part" ./var/lib/apt ./var/cache/apt
  mv "$OUT/base-$SUITE.tar.part" "$OUT/base-$SUITE.tar"
fi
if [ ! -s "$OUT/build-base-$SUITE.tar" ]; then
  # The builder trusts the extra CAs the host trusts (a TLS-inspecting egress
  # proxy in front of PyPI); the final base does not get them.
  log "builder base: mmdebstrap --variant=apt $SUITE + python$PYTHON_VERSION ca-certificates"
  mmdebstrap --quiet --format=tar --variant=apt --include="python$PYTHON_VERSION,ca-certificates" "${SLIM[@]}" \
    --customize-hook='if [ -d /usr/local/share/ca-certificates ]; then mkdir -p "$1/usr/local/share/ca-certificates" && cp -a /usr/local/share/ca-certificates/. "$1/usr/local/share/ca-certificates/"; fi' \
    --customize-hook='chroot "$1" update-ca-certificates' \
    "$SUITE" "$OUT/build-base-$SUITE.tar.part" "$MIRROR"
  mv "$OUT/build-base-$SUITE.tar.part" "$OUT/build-base-$SUITE.tar"
fi

# 2. uv from its wheel (the same version as the Dockerfile's UV_IMAGE default).
if [ ! -x "$OUT/uv/uv" ]; then
  log "uv $UV_VERSION from PyPI"
  rm -rf "$OUT/uv" && mkdir -p "$OUT/uv"
  "$HOST_PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
    --python-version 3.11 -d "$OUT/uv" "uv==$UV_VERSION"
  "$HOST_PYTHON" - "$OUT/uv" <<'EOF'
import pathlib, sys, zipfile
out = pathlib.Path(sys.argv[1])
wheel, = out.glob("uv-*.whl")
with zipfile.ZipFile(wheel) as z:
    name, = [n for n in z.namelist() if n.endswith(".data/scripts/uv")]
    (out / "uv").write_bytes(z.read(name))
(out / "uv").chmod(0o755)
EOF
fi

# 3. import into the private store (from scratch + the tarball, as `podman import` does).
import_rootfs() {  # name tarball
  local c
  buildah "${STORE[@]}" rmi -f "$1" >/dev/null 2>&1 || true
  c=$(buildah "${STORE[@]}" from scratch)
  buildah "${STORE[@]}" add "$c" "$2" / >/dev/null
  buildah "${STORE[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/sh "$c"
  buildah "${STORE[@]}" commit --quiet --rm "$c" "$1" >/dev/null
}
log "import into buildah's store $OUT/store"
# Working containers a killed or earlier run left behind (bud keeps the one of
# a stage that another stage copies from) hold overlay mounts: remove them.
buildah "${STORE[@]}" rm --all >/dev/null 2>&1 || true
import_rootfs "$BASE" "$OUT/base-$SUITE.tar"
import_rootfs "$BUILD_BASE" "$OUT/build-base-$SUITE.tar"
buildah "${STORE[@]}" rmi -f "$UV_IMAGE" >/dev/null 2>&1 || true
c=$(buildah "${STORE[@]}" from scratch)
buildah "${STORE[@]}" copy --chmod 0755 "$c" "$OUT/uv/uv" /uv >/dev/null
buildah "${STORE[@]}" commit --quiet --rm "$c" "$UV_IMAGE" >/dev/null

# 4. the Dockerfile, unchanged, on those bases. --network host: the RUN steps
# reach apt's mirror and PyPI as the host does (no uv python download:
# PYTHON_SOURCE=system takes Debian's python3.11 from the bases).
log "buildah bud Dockerfile (BASE=$BASE)"
if ! buildah "${STORE[@]}" bud --quiet --pull=never --network host --format oci \
  --build-arg BASE="$BASE" --build-arg BUILD_BASE="$BUILD_BASE" --build-arg UV_IMAGE="$UV_IMAGE" \
  --build-arg PYTHON_SOURCE=system \
  -t "$TAG" -f Dockerfile . >"$OUT/bud.log" 2>&1; then
  tail -n 40 "$OUT/bud.log" >&2
  die "buildah bud failed (whole log: $OUT/bud.log)"
fi

# 5. the OCI archive (gzip layers, as a registry would hold them).
log "push $TAG to oci-archive:$ARCHIVE"
rm -f "$ARCHIVE"
buildah "${STORE[@]}" push --quiet --compression-format gzip "$TAG" "oci-archive:$ARCHIVE:fracplugin:$VERSION" >&2
buildah "${STORE[@]}" rm --all >/dev/null 2>&1 || true
log "done in $(( $(date +%s) - start )) s: $(du -h "$ARCHIVE" | cut -f1) $ARCHIVE"
echo "$ARCHIVE"
