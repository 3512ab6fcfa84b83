#!/usr/bin/env bash
# make image: build the fracplugin image from the project's own Dockerfile
# without an image registry (ADR 0027, docs/e2e.md "make image"),
# for linux/amd64 and linux/arm64, as one OCI index.
#
#   1. for each architecture, two base root filesystems from Debian packages
#      (mmdebstrap --architectures=<arch>, Debian's python3.11): the final base
#      (essential packages + python3.11; no apt, no compiler, no pip) and the
#      builder base (apt + python3.11 + ca-certificates);
#   2. uv, the version the Dockerfile's UV_IMAGE default names, from its wheel on
#      PyPI (a package registry) for that architecture, as a one-file image;
#   3. the three imported into a private store of buildah (daemonless; runc),
#      with the architecture in their config;
#   4. `buildah bud --platform linux/<arch>` of the repository's Dockerfile with
#      BASE, BUILD_BASE, UV_IMAGE and PYTHON_SOURCE=system, network only for apt
#      and PyPI;
#   5. the images in one manifest list (buildah manifest create/add), written as
#      an OCI archive holding an OCI image index; its path is the last line printed.
#
# A foreign architecture's root filesystem and RUN steps run its binaries under
# qemu-user-static through the kernel's binfmt_misc: if arch-test says the
# architecture cannot run, this script mounts binfmt_misc and registers the
# handler qemu-user-static ships (/usr/lib/binfmt.d), as systemd-binfmt would.
#
# Needs root, mmdebstrap, buildah, runc, and for a foreign architecture
# qemu-user-static and arch-test (.ci/run installs them with apt-get).
# Env: FRACPLUGIN_IMAGE_ARCHES ("amd64 arm64"), FRACPLUGIN_IMAGE_SUITE (bookworm),
# FRACPLUGIN_IMAGE_MIRROR (http://deb.debian.org/debian), FRACPLUGIN_IMAGE_DIR (build/image),
# FRACPLUGIN_IMAGE_BUD_TIMEOUT_S (900: one bud's limit; a bud past it is tried once more).
# Cached: the base tarballs and the uv binary per architecture under
# build/image/<arch>/ (delete build/image for a cold build).
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
ARCHES=${FRACPLUGIN_IMAGE_ARCHES:-amd64 arm64}
# One bud takes about 130 s native and 210 s for arm64 under qemu on an idle
# 2-core machine; a RUN step under qemu once hung with no CPU for 30 min after
# uv had installed (docs/e2e.md, cold4). A bud past this is killed and tried once more.
BUD_TIMEOUT_S=${FRACPLUGIN_IMAGE_BUD_TIMEOUT_S:-900}
SUITE=${FRACPLUGIN_IMAGE_SUITE:-bookworm}
MIRROR=${FRACPLUGIN_IMAGE_MIRROR:-http://deb.debian.org/debian}
OUT=$(mkdir -p "${FRACPLUGIN_IMAGE_DIR:-build/image}" && cd "${FRACPLUGIN_IMAGE_DIR:-build/image}" && pwd)
PYTHON_VERSION=$(sed -n 's/^ARG PYTHON_VERSION=//p' Dockerfile)
UV_IMAGE_DEFAULT=$(sed -n 's/^ARG UV_IMAGE=//p' Dockerfile)
UV_VERSION=${UV_IMAGE_DEFAULT##*:}
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
[ -n "$PYTHON_VERSION" ] && [ -n "$UV_VERSION" ] && [ -n "$VERSION" ] \
  || die "could not read PYTHON_VERSION / UV_IMAGE from Dockerfile or version from pyproject.toml"

# A killed bud leaves its RUN step's processes (runc's, under qemu) holding the
# store's overlay mounts: kill every process whose root is inside the store.
kill_store_processes() {
  local p root
  for p in /proc/[0-9]*; do
    root=$(readlink "$p/root" 2>/dev/null) || continue
    case "$root" in "$OUT/store"/*) kill -9 "${p#/proc/}" 2>/dev/null || true ;; esac
  done
}

# Debian architecture -> what qemu, the kernel (uname -m) and manylinux wheels call it.
machine_of() {
  case "$1" in
    amd64) echo x86_64 ;;
    arm64) echo aarch64 ;;
    *) die "architecture $1: only amd64 and arm64 are built (FRACPLUGIN_IMAGE_ARCHES)" ;;
  esac
}
for arch in $ARCHES; do machine_of "$arch" >/dev/null; done

# A private store: nothing of the host's containers/storage is read or changed.
STORE=(--root "$OUT/store" --runroot "$OUT/run" --storage-driver overlay)
TAG=localhost/fracplugin:$VERSION
ARCHIVE=$OUT/fracplugin-$VERSION.oci.tar
start=$(date +%s)

# Leave out of every root filesystem what a daemon never reads.
SLIM=(--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias')

# A foreign architecture's binaries (dpkg's maintainer scripts, the builder's
# RUN steps, make image-test's emulated run) run through binfmt_misc and
# qemu-user-static. Where arch-test finds no working handler, register the one
# qemu-user-static ships, as systemd-binfmt or binfmt-support would at boot
# (flag F: the kernel opens the interpreter now, so it also works inside a
# chroot or container). It changes the kernel's handler table for that one ELF
# machine only; `echo -1 > /proc/sys/fs/binfmt_misc/qemu-<machine>` removes it.
ensure_emulation() {  # arch
  local arch=$1 machine conf
  machine=$(machine_of "$arch")
  [ "$(uname -m)" = "$machine" ] && return 0
  command -v arch-test >/dev/null && command -v "qemu-$machine-static" >/dev/null \
    || die "building $arch on $(uname -m) needs qemu-user-static and arch-test: apt-get install -y qemu-user-static arch-test"
  arch-test "$arch" >/dev/null 2>&1 && return 0
  conf=/usr/lib/binfmt.d/qemu-$machine.conf
  [ -r "$conf" ] || die "$conf missing (qemu-user-static's binfmt entry for $machine)"
  if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
      || die "cannot mount binfmt_misc: $arch's binaries cannot run here (a container without it needs the host to register qemu-$machine)"
  fi
  if [ ! -e "/proc/sys/fs/binfmt_misc/qemu-$machine" ]; then
    log "register binfmt_misc handler qemu-$machine ($conf)"
    grep -v '^#' "$conf" > /proc/sys/fs/binfmt_misc/register || die "cannot register $conf with binfmt_misc"
  else
    echo 1 > "/proc/sys/fs/binfmt_misc/qemu-$machine"  # present but disabled
  fi
  arch-test "$arch" >/dev/null 2>&1 || die "arch-test $arch still fails after registering qemu-$machine"
}

# 3. import into the private store (from scratch + the tarball, as `podman import` does).
import_rootfs() {  # name tarball arch
  local c
  buildah "${STORE[@]}" rmi -f "$1" >/dev/null 2>&1 || true
  c=$(buildah "${STORE[@]}" from scratch)
  buildah "${STORE[@]}" add "$c" "$2" / >/dev/null
  buildah "${STORE[@]}" config --arch "$3" --os linux \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/sh "$c"
  buildah "${STORE[@]}" commit --quiet --rm "$c" "$1" >/dev/null
}

build_arch() {  # arch: steps 1-4 for one architecture; tags $TAG-$arch
  local arch=$1 machine dir base build_base uv_image c t0
  t0=$(date +%s)
  machine=$(machine_of "$arch")
  dir=$OUT/$arch
  mkdir -p "$dir"
  base=localhost/fracplugin-base:$SUITE-python$PYTHON_VERSION-$arch
  build_base=localhost/fracplugin-build-base:$SUITE-python$PYTHON_VERSION-$arch
  uv_image=localhost/fracplugin-uv:$UV_VERSION-$arch
  ensure_emulation "$arch"

  # 1. base root filesystems (mmdebstrap removes apt's package lists and caches by default).
  if [ ! -s "$dir/base-$SUITE.tar" ]; then
    # libstdc++6: grpcio's native module (the kubelet door, ADR 0021) links it;
    # the essential variant does not carry it (image-test imports every module).
    log "$arch final base: mmdebstrap --variant=essential $SUITE + python$PYTHON_VERSION libstdc++6"
    mmdebstrap --quiet --format=tar --architectures="$arch" --variant=essential \
      --include="python$PYTHON_VERSION,libstdc++6" "${SLIM[@]}" \
      "$SUITE" "$dir/base-$SUITE.tar.part" "$MIRROR"
    # The essential variant has no apt, but mmdebstrap's cleanup leaves apt's
    # state directories (the lists lock, lists/partial) in the tarball, after
    # any hook: drop them from the archive itself.
    tar --delete -f "$dir/base-$SUITE.tar.part" ./var/lib/apt ./var/cache/apt
    mv "$dir/base-$SUITE.tar.part" "$dir/base-$SUITE.tar"
  fi
  if [ ! -s "$dir/build-base-$SUITE.tar" ]; then
    # The builder trusts the extra CAs the host trusts (a TLS-inspecting egress
    # proxy in front of PyPI); the final base does not get them.
    log "$arch builder base: mmdebstrap --variant=apt $SUITE + python$PYTHON_VERSION ca-certificates"
    mmdebstrap --quiet --format=tar --architectures="$arch" --variant=apt \
      --include="python$PYTHON_VERSION,ca-certificates" "${SLIM[@]}" \
      --customize-hook='if [ -d /usr/local/share/ca-certificates ]; then mkdir -p "$1/usr/local/share/ca-certificates" && cp -a /usr/local/share/ca-certificates/. "$1/usr/local/share/ca-certificates/"; fi' \
      --customize-hook='chroot "$1" update-ca-certificates' \
      "$SUITE" "$dir/build-base-$SUITE.tar.part" "$MIRROR"
    mv "$dir/build-base-$SUITE.tar.part" "$dir/build-base-$SUITE.tar"
  fi

  # 2. uv from its wheel (the same version as the Dockerfile's UV_IMAGE default).
  if [ ! -x "$dir/uv/uv" ]; then
    log "$arch uv $UV_VERSION from PyPI"
    rm -rf "$dir/uv" && mkdir -p "$dir/uv"
    "$HOST_PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform "manylinux_2_17_$machine" \
      --python-version 3.11 -d "$dir/uv" "uv==$UV_VERSION"
    "$HOST_PYTHON" - "$dir/uv" <<'PY'
import pathlib, sys, zipfile
out = pathlib.Path(sys.argv[1])
wheel, = out.glob("uv-*.whl")
with zipfile.ZipFile(wheel) as z:
    name, = [n for n in z.namelist() if n.endswith(".data/scripts/uv")]
    (out / "uv").write_bytes(z.read(name))
(out / "uv").chmod(0o755)
PY
  fi

  # 3. the bases and uv in buildah's store, each with its architecture.
  log "$arch import into buildah's store $OUT/store"
  import_rootfs "$base" "$dir/base-$SUITE.tar" "$arch"
  import_rootfs "$build_base" "$dir/build-base-$SUITE.tar" "$arch"
  buildah "${STORE[@]}" rmi -f "$uv_image" >/dev/null 2>&1 || true
  c=$(buildah "${STORE[@]}" from scratch)
  buildah "${STORE[@]}" copy --chmod 0755 "$c" "$dir/uv/uv" /uv >/dev/null
  buildah "${STORE[@]}" config --arch "$arch" --os linux "$c"
  buildah "${STORE[@]}" commit --quiet --rm "$c" "$uv_image" >/dev/null

  # 4. the Dockerfile, unchanged, on those bases. --network host: the RUN steps
  # reach apt's mirror and PyPI as the host does (no uv python download:
  # PYTHON_SOURCE=system takes Debian's python3.11 from the bases). A foreign
  # architecture's RUN steps run under qemu (ensure_emulation).
  local try rc=0
  for try in 1 2; do
    log "$arch buildah bud --platform linux/$arch Dockerfile (BASE=$base), try $try of 2, at most ${BUD_TIMEOUT_S} s"
    buildah "${STORE[@]}" rmi -f "$TAG-$arch" >/dev/null 2>&1 || true
    rc=0
    timeout -k 30 "$BUD_TIMEOUT_S" buildah "${STORE[@]}" bud --quiet --pull=never --network host --format oci \
      --platform "linux/$arch" \
      --build-arg BASE="$base" --build-arg BUILD_BASE="$build_base" --build-arg UV_IMAGE="$uv_image" \
      --build-arg PYTHON_SOURCE=system \
      -t "$TAG-$arch" -f Dockerfile . >"$dir/bud.log" 2>&1 || rc=$?
    [ "$rc" = 0 ] && break
    tail -n 40 "$dir/bud.log" >&2
    # 124/137: timed out. Only a hang is retried; a failing step fails again.
    case "$rc" in 124|137) ;; *) die "buildah bud for $arch failed (exit $rc; whole log: $dir/bud.log)" ;; esac
    kill_store_processes
    buildah "${STORE[@]}" rm --all >/dev/null 2>&1 || true
    log "$arch buildah bud hung past ${BUD_TIMEOUT_S} s (FRACPLUGIN_IMAGE_BUD_TIMEOUT_S)"
  done
  [ "$rc" = 0 ] || die "buildah bud for $arch hung twice past ${BUD_TIMEOUT_S} s (whole log: $dir/bud.log)"
  buildah "${STORE[@]}" rm --all >/dev/null 2>&1 || true
  log "$arch built in $(( $(date +%s) - t0 )) s"
}

# Working containers a killed or earlier run left behind (bud keeps the one of
# a stage that another stage copies from) hold overlay mounts: remove them.
buildah "${STORE[@]}" rm --all >/dev/null 2>&1 || true
for arch in $ARCHES; do build_arch "$arch"; done

# 5. one manifest list (an OCI image index) over the architectures' images, and
# the OCI archive of it and all its images (gzip layers, as a registry holds them).
log "manifest list $TAG ($ARCHES)"
buildah "${STORE[@]}" manifest rm "$TAG" >/dev/null 2>&1 || true
buildah "${STORE[@]}" rmi -f "$TAG" >/dev/null 2>&1 || true
buildah "${STORE[@]}" manifest create "$TAG" >/dev/null
for arch in $ARCHES; do
  buildah "${STORE[@]}" manifest add --os linux --arch "$arch" "$TAG" "containers-storage:$TAG-$arch" >/dev/null
done
log "push $TAG to oci-archive:$ARCHIVE"
rm -f "$ARCHIVE"
buildah "${STORE[@]}" manifest push --quiet --all --format oci "$TAG" "oci-archive:$ARCHIVE:fracplugin:$VERSION" >&2
buildah "${STORE[@]}" rm --all >/dev/null 2>&1 || true
log "done in $(( $(date +%s) - start )) s: $(du -h "$ARCHIVE" | cut -f1) $ARCHIVE"
echo "$ARCHIVE"
