# fracplugin developer entry points. Everything runs from the repo root.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup test unit component proto demo interop e2e bench ci clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

## setup: create .venv and install fracplugin with its test extras
setup: $(VENV)/.installed

## test: the whole Python test suite (unit + component); interop and e2e have their own targets
test: setup
	$(PY) -m pytest tests/unit tests/component -q

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

## bench: benchmarks; writes build/bench.json
bench: setup
	mkdir -p build
	$(PY) tests/bench/run_all.py

ci: test interop e2e

clean:
	rm -rf build .pytest_cache .hypothesis tests/interop/bin
