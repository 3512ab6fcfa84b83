# fracplugin developer entry points. Everything runs from the repo root.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: sbom actionlint setup test typecheck unit component proto demo interop e2e kai-e2e kubelet-e2e cluster-e2e bench chart manifests chart-tools ci clean gpu-check gpu-check-wheels image image-test admission-e2e

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

## setup: create .venv and install fracplugin with its test extras
setup: $(VENV)/.installed

## test: mypy --strict over src/ (zero errors), then the whole Python test suite (unit + component); interop and e2e have their own targets
test: setup typecheck
	$(PY) -m pytest tests/unit tests/component -q

## typecheck: mypy --strict over src/fracplugin and the demo's src/fracplugin_demo, zero errors (config and the reasoned exceptions in pyproject.toml [tool.mypy])
typecheck: setup
	$(PY) -m mypy --strict src/fracplugin src/fracplugin_demo

unit: setup
	$(PY) -m pytest tests/unit -q

component: setup
	$(PY) -m pytest tests/component -q

## proto: regenerate src/fracplugin/_proto from proto/
proto: setup
	$(PY) scripts/genproto.py

## demo: run the daemon on the simulated four-GPU node and drive both doors
demo: setup
	$(VENV)/bin/fracplugin demo

## interop: drive the daemon with containerd/nri's adaptation and the kubelet API stubs (needs Go)
interop: setup
	bash tests/interop/run.sh

## e2e: real containerd + runc + crictl with our plugin attached (needs root)
e2e: setup
	bash tests/e2e/run.sh

## kai-e2e: KAI's node condition against a real etcd + kube-apiserver (binaries from the kubelet-e2e build cache)
kai-e2e: setup
	$(PY) tests/kai_e2e/run.py

## admission-e2e: the chart's ValidatingAdmissionPolicy (ADR 0026) in Kubernetes' own CEL environment (Go,
## tests/admission_e2e/celeval) and on a real etcd + kube-apiserver per Kubernetes line (kubelet-e2e build cache)
admission-e2e: setup
	$(PY) -m pytest tests/admission_e2e -q -p no:cacheprovider

## kubelet-e2e: real etcd + kube-apiserver + kubelet (v1.37 and v1.35) + containerd with both doors (needs root)
kubelet-e2e: setup
	bash tests/kubelet_e2e/run.sh

## cluster-e2e: the shipped install (make image's image + the Helm chart) on a real one-node cluster (etcd,
## kube-apiserver, kube-controller-manager, kube-scheduler, kubelet v1.37 and v1.35, containerd, CNI bridge); needs root and make image first
cluster-e2e: setup
	bash tests/cluster_e2e/run.sh

## image: build the image for linux/amd64 and linux/arm64 from the Dockerfile without an image registry
## (mmdebstrap bases with Debian's python3.11, buildah; the foreign one under qemu-user-static; needs root,
## mmdebstrap, buildah, runc, qemu-user-static, arch-test; ADR 0027). One OCI index in an OCI archive: the last line is its path.
image:
	@bash scripts/build-image.sh

## image-test: check both images of the archive make image wrote (config, every ELF file's architecture, contents,
## size, SBOM) and run the native one under runc, the other by chroot under qemu
image-test: setup
	$(PY) -m pytest tests/image -q -p no:cacheprovider

## sbom: an SPDX SBOM per architecture of make image's archive (Debian packages + the virtualenv's
## distributions; scripts/image_sbom.py) -> build/image/fracplugin-<version>-linux-<arch>.spdx.json
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml | head -1)
sbom: setup
	$(PY) scripts/image_sbom.py build/image/fracplugin-$(VERSION).oci.tar build/image

## actionlint: check .github/workflows (the release workflow) with actionlint, built from its Go module
## (cached, scripts/chart-tools.sh), with shellcheck on every run: step (apt-get install shellcheck)
actionlint:
	@set -e; tools=$$(bash scripts/chart-tools.sh actionlint); eval "$$tools"; \
	sc=$$(command -v shellcheck) || { echo "actionlint: shellcheck not found: apt-get install -y shellcheck" >&2; exit 1; }; \
	echo "actionlint: $$("$$ACTIONLINT" -version | head -1) at $$ACTIONLINT, shellcheck $$("$$sc" --version | sed -n 's/^version: //p')"; \
	"$$ACTIONLINT" -shellcheck "$$sc" -pyflakes= -no-color; \
	echo "actionlint: $$(ls .github/workflows/*.y*ml | wc -l) workflow(s), no problem found"

## bench: benchmarks; writes build/bench.json
bench: setup
	mkdir -p build
	$(PY) tests/bench/run_all.py

## gpu-check: on a machine with an NVIDIA GPU, as root: real NVML, real MPS, CUDA clients -> gpu-check.json
## (any python3 >= 3.11, not the venv; exits 2 in one line where there is no GPU; docs/gpu-check.md)
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	@$(GPU_PYTHON) tests/gpu/gpu_check.py --out gpu-check.json $(GPU_CHECK_ARGS)

## gpu-check-wheels: download (here, where pip can) the wheels gpu-check carries to the GPU machine (tests/gpu/wheels, git-ignored)
GPU_WHEELS_PYTHON ?= 3.12
gpu-check-wheels: setup
	rm -rf tests/gpu/wheels build/gpu-check-requirements.txt
	mkdir -p tests/gpu/wheels build
	$(PY) -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
		> build/gpu-check-requirements.txt
	$(PY) -m pip download -q -d tests/gpu/wheels -r build/gpu-check-requirements.txt --only-binary=:all: \
		--python-version $(GPU_WHEELS_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64
	@ls tests/gpu/wheels | wc -l | xargs echo "wheels in tests/gpu/wheels:"; du -sh tests/gpu/wheels

## chart-tools: build (or reuse) helm and promtool from their Go modules (cached; see docs/helm.md)
chart-tools:
	bash scripts/chart-tools.sh

## chart: helm lint/template for each values set, Kubernetes + CRD schemas, chart vs daemon defaults,
## daemonset/ current, promtool rule tests, dashboard check (builds helm and promtool if needed)
chart: setup
	@set -e; tools=$$(bash scripts/chart-tools.sh); eval "$$tools"; export HELM PROMTOOL; \
	echo "chart: $$("$$HELM" version --short) at $$HELM"; echo "chart: $$("$$PROMTOOL" --version 2>&1 | head -1) at $$PROMTOOL"; \
	$(PY) -m pytest tests/chart tests/unit/test_dashboard.py tests/unit/test_manifests.py -q -p no:cacheprovider

## manifests: regenerate daemonset/ (kustomize) from the Helm chart
manifests: setup
	@set -e; tools=$$(bash scripts/chart-tools.sh helm); eval "$$tools"; export HELM; \
	$(PY) scripts/render_manifests.py

ci: test chart actionlint interop e2e kubelet-e2e admission-e2e image image-test cluster-e2e

clean:
	@# make image's private buildah store keeps a bind mount of its overlay directory
	@if [ -d build/image/store ]; then \
		buildah --root "$(CURDIR)/build/image/store" --runroot "$(CURDIR)/build/image/run" rm --all >/dev/null 2>&1; \
		umount -R "$(CURDIR)/build/image/store/overlay" 2>/dev/null; true; fi
	rm -rf build .pytest_cache .hypothesis tests/interop/bin
