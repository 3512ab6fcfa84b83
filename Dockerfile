# syntax=docker/dockerfile:1
# fracplugin node daemon image. Build: docker build -t fracplugin:0.1.0 .
# Choices and reasons: docs/adr/0002-deployment.md.
#
# Final stage: by default a CUDA *base* image (no toolkit). libnvidia-ml (NVML),
# nvidia-smi and nvidia-cuda-mps-control / -server are NOT in the image: they
# belong to the host driver and the NVIDIA container toolkit injects them when
# the pod runs with NVIDIA_DRIVER_CAPABILITIES=compute,utility (mps-nvml.md
# section 2.3; kubelet-device-plugin.md B.4). By default Python 3.11 is a
# relocatable python-build-standalone interpreter installed by uv in the
# builder; the final stage receives only that interpreter and a virtualenv
# with the wheel and its dependencies, no compiler, pip, uv or apt lists.
#
# Every base is an argument. The defaults are what a user with access to
# Docker Hub and ghcr.io gets. `make image` (scripts/build-image.sh, ADR 0027)
# builds this same file without an image registry: BASE and BUILD_BASE are
# Debian root filesystems made with mmdebstrap (Debian's python3.11),
# UV_IMAGE holds uv from its PyPI wheel, and PYTHON_SOURCE=system makes the
# virtualenv on the bases' /usr/bin/python3.11 instead of downloading one.

ARG BASE=nvidia/cuda:12.8.0-base-ubuntu22.04
ARG BUILD_BASE=ubuntu:22.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.8.14
ARG PYTHON_VERSION=3.11
# managed: uv installs python-build-standalone into /opt/python (default);
# system: the bases' own python${PYTHON_VERSION} (BASE must then carry the
# same interpreter as BUILD_BASE; /opt/python stays empty).
ARG PYTHON_SOURCE=managed

FROM ${UV_IMAGE} AS uv

# Builder on the same Ubuntu release as the final stage, so that the wheels
# uv picks (manylinux tags) match the final stage's glibc.
FROM ${BUILD_BASE} AS build
ARG PYTHON_VERSION
ARG PYTHON_SOURCE
COPY --from=uv /uv /usr/local/bin/uv
# UV_NATIVE_TLS: uv trusts the builder's CA store (ca-certificates below), as
# apt does, rather than its compiled-in roots.
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-${PYTHON_SOURCE} \
    UV_NATIVE_TLS=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1
# CA roots for the downloads (interpreter, wheels); builder stage only.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN case "${PYTHON_SOURCE}" in \
      managed) uv python install "${PYTHON_VERSION}" ;; \
      system) mkdir -p /opt/python ;; \
      *) echo "PYTHON_SOURCE=${PYTHON_SOURCE}: must be managed or system" >&2; exit 2 ;; \
    esac \
 && uv venv --python "${PYTHON_VERSION}" /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN uv build --wheel --out-dir /dist . \
 && uv pip install --python /opt/venv/bin/python /dist/*.whl \
 && /opt/venv/bin/fracplugin version

FROM ${BASE}
LABEL org.opencontainers.image.title="fracplugin" \
      org.opencontainers.image.description="Node daemon for memory-enforced fractional GPU sharing on Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
# NVIDIA_DISABLE_REQUIRE: the daemon uses no CUDA runtime, only NVML and the
# MPS binaries of whatever driver the node has; skip the base image's
# "cuda>=12.8" driver check so the daemon also starts on older drivers.
# MALLOC_ARENA_MAX=2: glibc otherwise gives each of the daemon's ~35 threads
# (handlers, gRPC, NRI, MPS) its own malloc arena, up to 8 per core; two
# arenas measured 0.5 MiB less resident memory at ready and bound the growth
# on many-core nodes (docs/benchmarks.md, memory; issue 14).
ENV NVIDIA_DISABLE_REQUIRE=true \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MALLOC_ARENA_MAX=2
# Same paths as in the builder: the venv's python is a link into /opt/python
# (managed) or to the base's /usr/bin/python3.11 (system).
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv
# Root on purpose: the daemon sets GPU compute modes through NVML, runs the
# MPS control daemon in multi-user mode (root-owned servers serve clients of
# any UID), connects to the root-owned NRI and kubelet sockets, and reads
# /proc of every container (hostPID). None of this works as another user.
USER 0:0
EXPOSE 2112 8080
# Kubernetes ignores HEALTHCHECK (the DaemonSet has probes); this serves
# `docker run` and other engines. No curl in the image: Python's urllib fails
# (exit 1) on a refused connection or a non-2xx status.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["fracplugin", "run"]
