"""Issue 13 item 4: ``fracplugin explain`` on malformed input exits 2 with one
line naming the file and what is wrong, never a traceback, never 1 (1 means
"refused by the planner").

A hypothesis property over random YAML: a valid pod (or node) document with
random subtrees replaced by random YAML values, random bytes, and the cases
the fuzzing in the issue found (annotations or spec not mappings, a
non-UTF-8 file, deep nesting, a non-string container name). The in-process
property calls ``explain.main`` (the code ``fracplugin explain`` runs); the
listed cases also run as a real subprocess to see stderr as a user does.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fracplugin import explain

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "examples" / "nodes" / "gpu-node-1.yaml"
POD = REPO / "examples" / "pods" / "inference-sm-sharing-4gpu.bound.yaml"
VALID_POD = yaml.safe_load(POD.read_text())
VALID_NODE = yaml.safe_load(NODE.read_text())

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)



def explain_args(*argv: str) -> argparse.Namespace:
    """``argv`` parsed as ``fracplugin explain`` parses it."""
    p = argparse.ArgumentParser()
    explain.add_arguments(p)
    return p.parse_args(list(argv))

def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    doc = copy.deepcopy(doc)
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return doc


@st.composite
def mutated(draw: Any, base: Any) -> str:
    doc = base
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        doc = _replace(doc, draw(st.sampled_from(paths)), draw(values))
    return yaml.safe_dump(doc, allow_unicode=True)


def run_main(tmp: Path, pod_text: str | bytes, node_text: str | bytes | None = None,
             capsys: Any = None) -> tuple[int, str, str]:
    pod, node = tmp / "pod.yaml", tmp / "node.yaml"
    (pod.write_bytes if isinstance(pod_text, bytes) else pod.write_text)(pod_text)  # type: ignore[operator]
    if node_text is None:
        node = NODE
    else:
        (node.write_bytes if isinstance(node_text, bytes) else node.write_text)(node_text)  # type: ignore[operator]
    rc = explain.main(explain_args(str(pod), "--node", str(node), "--reserve-mib", "0"))
    out, err = capsys.readouterr()
    return rc, out, err


def check(rc: int, err: str, names: str) -> None:
    assert rc in (0, 1, 2), rc
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fracplugin explain: ") and names in lines[0], err
    assert "Traceback" not in err


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(text=mutated(VALID_POD))
def test_random_pod_documents_never_crash(tmp_path: Path, capsys: Any, text: str) -> None:
    rc, _, err = run_main(tmp_path, text, capsys=capsys)
    check(rc, err, "pod")


@FUZZ
@given(text=mutated(VALID_NODE))
def test_random_node_documents_never_crash(tmp_path: Path, capsys: Any, text: str) -> None:
    rc, _, err = run_main(tmp_path, POD.read_text(), text, capsys=capsys)
    check(rc, err, "node")
    assert rc != 1 or "REFUSED" in _


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_random_bytes_never_crash(tmp_path: Path, capsys: Any, data: Any) -> None:
    rc, _, err = run_main(tmp_path, data, capsys=capsys)
    check(rc, err, "pod")
    assert rc != 1


ISSUE_CASES = [
    ("annotations a list", "kind: Pod\nmetadata: {name: p, annotations: [a, b]}\nspec: {containers: [{name: app}]}\n",
     "metadata.annotations must be a mapping of strings, got a list"),
    ("annotations a string", "kind: Pod\nmetadata: {name: p, annotations: abc}\n",
     "metadata.annotations must be a mapping of strings, got a string"),
    ("annotation value a mapping", "kind: Pod\nmetadata: {name: p, annotations: {k: {x: 1}}}\n",
     "metadata.annotations['k'] must be a string, got a mapping"),
    ("spec a list", "kind: Pod\nmetadata: {name: p}\nspec: [1, 2]\n", "spec must be a mapping, got a list"),
    ("containers a string", "kind: Pod\nmetadata: {name: p}\nspec: {containers: abc}\n",
     "spec.containers must be a list of containers, got a string"),
    ("container name a number", "kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: 7}]}\n",
     "spec.containers[0].name must be a non-empty string, got a number"),
    ("container name a list", "kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: [a]}]}\n",
     "spec.containers[0].name must be a non-empty string, got a list"),
    ("metadata a list", "kind: Pod\nmetadata: [1]\n", "metadata must be a mapping, got a list"),
    ("non-UTF-8", b"kind: Pod\nmetadata: {name: \xff\xfe}\n", "is not UTF-8 text (byte 27)"),
    ("deep nesting", "kind: Pod\nmetadata: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("duplicate container", "kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: a}, {name: a}]}\n",
     'spec.containers[1].name "a" is used twice'),
]


@pytest.mark.parametrize(("content", "fragment"), [c[1:] for c in ISSUE_CASES], ids=[c[0] for c in ISSUE_CASES])
def test_malformed_pod_files_exit_2_in_one_line(tmp_path: Path, content: str | bytes, fragment: str) -> None:
    pod = tmp_path / "pod.yaml"
    (pod.write_bytes if isinstance(content, bytes) else pod.write_text)(content)  # type: ignore[operator]
    r = subprocess.run([sys.executable, "-m", "fracplugin.cli", "explain", str(pod), "--node", str(NODE)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(pod) in lines[0] and fragment in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_node_file_not_utf8_or_overflowing_exit_2(tmp_path: Path, capsys: Any) -> None:
    rc, _, err = run_main(tmp_path, POD.read_text(), b"gpus: [\xff]\n", capsys=capsys)
    assert rc == 2 and "is not UTF-8 text" in err
    bad = copy.deepcopy(VALID_NODE)
    bad["gpus"][0]["memory_mib"] = float("inf")
    rc, _, err = run_main(tmp_path, POD.read_text(), yaml.safe_dump(bad), capsys=capsys)
    assert rc == 2 and "gpus[0]" in err


def test_ledger_that_is_not_a_ledger_exits_2(tmp_path: Path, capsys: Any) -> None:
    led = tmp_path / "ledger.json"
    led.write_bytes(b"\x00\xffnot json")
    assert explain.main(explain_args(str(POD), "--node", str(NODE), "--ledger", str(led), "--reserve-mib", "0")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(led) in err
