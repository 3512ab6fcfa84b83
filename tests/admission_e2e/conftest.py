"""tests/admission_e2e: the chart's ValidatingAdmissionPolicy (ADR 0026)
evaluated by Kubernetes itself, as ``make admission-e2e`` runs it:

- test_cel_eval.py: the policy's CEL in Kubernetes' own CEL environment
  (celeval/, Go, k8s.io/apiserver), against ``fracplugin explain`` on the
  contract's table and on generated annotation sets;
- test_admission_apiserver.py: a real etcd + kube-apiserver per Kubernetes
  line (the binaries of the kubelet-e2e build), the policy created, each bad
  pod of the table refused at create with explain's message, each good one
  admitted.

Missing Go or binaries fail, naming what is missing (never a skip).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def go_binary() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        pytest.fail("admission-e2e needs the Go toolchain (celeval is built with k8s.io/apiserver's CEL libraries)")
    return go


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A cold celeval build (cel-go, k8s.io/apiserver) and a kube-apiserver
    start take minutes on a busy 2-core machine: the first test of each pays
    them, so these tests get 30 minutes, not the suite's default."""
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(1800))


@pytest.fixture(scope="session")
def celeval() -> Path:
    """The celeval binary, built once into build/ (module cache and proxy as
    any `go build`: the first build downloads cel-go and k8s.io/apiserver)."""
    out = REPO / "build" / "celeval"
    out.parent.mkdir(exist_ok=True)
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    r = subprocess.run([go_binary(), "build", "-o", str(out), "."], cwd=HERE / "celeval", env=env,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        pytest.fail(f"building tests/admission_e2e/celeval failed:\n{r.stdout}{r.stderr}")
    return out
