"""The install, upgrade and uninstall commands of docs/operator-guide.md (and
the DRA example of docs/user-guide.md), read from those pages so
that ``make cluster-e2e`` runs exactly what a user is told to run (issue 24,
"the guide's install section is exactly what the test runs").

``commands(marker)`` returns the commands of the first ```sh block after
``marker`` in the guide (backslash continuations joined, comments dropped),
each an argv list with the guide's placeholders filled in (``PLACEHOLDERS``).
The harness runs a ``helm`` command with the real helm as the guide has it,
adding only the test-only values files (``-f``) at the end; a ``kubectl``
command is run through the API by ``Kubectl`` in conftest.py (kubectl is not
built here), which knows exactly the verbs the guide uses and fails, naming the
line, on any other: a guide edit the test cannot follow fails the test
instead of being silently skipped.
"""

from __future__ import annotations

import shlex
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent.parent / "docs"
OPERATOR_GUIDE = DOCS / "operator-guide.md"  # install, upgrade, uninstall
USER_GUIDE = DOCS / "user-guide.md"  # the DRA example

# The markers of the guide's blocks (the text right before each ```sh block).
INSTALL = "push it where the nodes can pull it, and install the Helm chart"
UPGRADE = "Upgrading to a new image with the same values"
UNINSTALL = "Uninstall (stopping MPS on purpose)"
UNINSTALL_SINGLE = "With `layout=single` there is no MPS role to ask"
# The guide's DRA example (a ```yaml block: the ResourceClaimTemplate and the pod that uses it), created as it stands
# by the DRA scenarios of tests/cluster_e2e/test_dra.py (only the pod's image is this cluster's).
DRA_EXAMPLE = "A claim template asking 20Gi of one GPU"

# The guide's placeholders -> what this cluster has: the image `make image` built,
# imported into containerd as docker.io/library/fracplugin:<tag>.
UPGRADE_TAG = "0.1.0-e2e-upgrade"  # the same archive under a second tag (fullcluster.py imports it so)
PLACEHOLDERS = {"<registry>": "docker.io/library", "<new-tag>": UPGRADE_TAG}
# Placeholders with a space, made one word before the line is split.
MPS_POD = "<fracplugin-mps-pod>"
ONE_WORD = {"<fracplugin-mps pod>": MPS_POD, "<new tag>": "<new-tag>"}


class ReadmeError(AssertionError):
    """The guide lacks a block the test runs, or has a command it cannot run."""


def doc_of(marker: str) -> Path:
    """The page a marker's block is read from: the user guide for the DRA
    example, the operator guide for the install, upgrade and uninstall."""
    return USER_GUIDE if marker == DRA_EXAMPLE else OPERATOR_GUIDE


def block(marker: str, text: str | None = None, lang: str = "sh") -> str:
    """The body of the first ```<lang> block after ``marker`` in the guide.
    Raises ReadmeError when the marker or the block is missing."""
    doc = doc_of(marker)
    text = doc.read_text() if text is None else text
    at = text.find(marker)
    if at < 0:
        raise ReadmeError(f"docs/{doc.name} has no {marker!r}: the cluster e2e runs the {lang} block after it")
    fence = f"```{lang}\n"
    start = text.find(fence, at)
    end = text.find("```", start + len(fence)) if start >= 0 else -1
    if start < 0 or end < 0:
        raise ReadmeError(f"docs/{doc.name} has no ```{lang} block after {marker!r}")
    return text[start + len(fence):end]


def yaml_docs(marker: str, text: str | None = None) -> dict[str, dict]:
    """The manifests of the guide's ```yaml block after ``marker``, by kind
    (one of each kind). Raises ReadmeError when the block is missing, does
    not parse, or holds two manifests of one kind."""
    import yaml

    try:
        docs = [d for d in yaml.safe_load_all(block(marker, text, lang="yaml")) if d]
    except yaml.YAMLError as e:
        raise ReadmeError(f"the guide's yaml block after {marker!r} does not parse: {e}") from None
    out: dict[str, dict] = {}
    for d in docs:
        kind = d.get("kind") if isinstance(d, dict) else None
        if not kind or kind in out:
            raise ReadmeError(f"the guide's yaml block after {marker!r}: a manifest without a kind, or two of "
                              f"kind {kind!r}")
        out[kind] = d
    return out


def commands(marker: str, text: str | None = None, fill: bool = True) -> list[list[str]]:
    """The commands of the guide's sh block after ``marker``: one argv per
    command (continuation lines joined, ``# ...`` comments dropped), with
    ``PLACEHOLDERS`` filled in when ``fill``. Raises ReadmeError."""
    out: list[list[str]] = []
    pending = ""
    for line in block(marker, text).splitlines():
        line = pending + line
        pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        for k, v in ONE_WORD.items():
            line = line.replace(k, v)
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if fill:
            for k, v in PLACEHOLDERS.items():
                argv = [a.replace(k, v) for a in argv]
        out.append(argv)
    return out


def one(marker: str, tool: str, verb: str) -> list[str]:
    """The single ``<tool> <verb> ...`` command of the guide's block after
    ``marker`` (e.g. ``helm install``). Raises ReadmeError when there is not
    exactly one."""
    found = [c for c in commands(marker) if c[:2] == [tool, verb]]
    if len(found) != 1:
        raise ReadmeError(f"the guide's block after {marker!r} has {len(found)} `{tool} {verb}` commands, not 1")
    return found[0]


def kubectl_op(argv: list[str]) -> tuple[str, str, list[str], list[str]]:
    """What a guide ``kubectl`` line does, as ``(op, namespace, names, cmd)``:

    - ``("create-namespace", "", [name], [])``
    - ``("label-namespace", "", [name, "k=v", ...], [])``
    - ``("exec", ns, [daemonset], cmd)``: ``exec ds/<name> -- cmd`` or
      ``exec <fracplugin-mps pod> -- cmd`` (daemonset ``fracplugin-mps``)
    - ``("delete-daemonsets-foreground", ns, names, [])``

    The only kubectl lines the cluster e2e can run through the API (conftest's
    ``Kubectl``). Raises ReadmeError naming any other line."""
    line = " ".join(argv)
    if argv[:1] != ["kubectl"]:
        raise ReadmeError(f"not a kubectl line: {line}")
    rest, ns = list(argv[1:]), "default"
    if rest[:1] == ["-n"] and len(rest) > 2:
        ns, rest = rest[1], rest[2:]
    if rest[:2] == ["create", "namespace"] and len(rest) == 3:
        return "create-namespace", "", [rest[2]], []
    if rest[:2] == ["label", "namespace"] and len(rest) >= 4 and all("=" in x for x in rest[3:]):
        return "label-namespace", "", rest[2:], []
    if rest[:1] == ["exec"] and len(rest) > 3 and rest[2] == "--":
        target = rest[1]
        ds = target[3:] if target.startswith("ds/") else "fracplugin-mps" if target == MPS_POD else ""
        if ds:
            return "exec", ns, [ds], rest[3:]
    if rest[:2] == ["delete", "daemonset"] and len(rest) > 3 and rest[-1] == "--cascade=foreground":
        return "delete-daemonsets-foreground", ns, rest[2:-1], []
    raise ReadmeError(f"the guide's `{line}` is a kubectl line the cluster e2e cannot run through the API: teach "
                      "tests/cluster_e2e/readme.py kubectl_op and conftest.py Kubectl (and docs/e2e.md) what it does")


def blocks_the_test_runs() -> dict[str, list[list[str]]]:
    """The guide's four blocks the cluster e2e runs, by marker. Raises
    ReadmeError when one is missing or holds a command the test cannot run
    (a ``kubectl`` line ``kubectl_op`` refuses, or neither helm nor kubectl)."""
    out = {m: commands(m) for m in (INSTALL, UPGRADE, UNINSTALL, UNINSTALL_SINGLE)}
    for m, cmds in out.items():
        for argv in cmds:
            if argv[0] == "kubectl":
                kubectl_op(argv)
            elif argv[0] != "helm":
                raise ReadmeError(f"the guide's block after {m!r} runs {argv[0]}: the test runs helm and kubectl only")
    one(INSTALL, "helm", "install")
    one(UPGRADE, "helm", "upgrade")
    return out
