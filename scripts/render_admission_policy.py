#!/usr/bin/env python3
"""Generate the chart's ValidatingAdmissionPolicy from the annotation contract.

    .venv/bin/python scripts/render_admission_policy.py           write the template
    .venv/bin/python scripts/render_admission_policy.py --check   exit 1 when it is stale

Writes deploy/helm/fracplugin/templates/admissionpolicy.yaml from
fracplugin_demo.admission.helm_template() (the CEL generated from contract.py and
annotations.py, ADR 0026). tests/unit/test_admission_policy.py fails when the
committed file differs from this output.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from fracplugin_demo.admission import helm_template  # noqa: E402

TEMPLATE = REPO / "deploy" / "helm" / "fracplugin" / "templates" / "admissionpolicy.yaml"


def main(argv: list[str]) -> int:
    text = helm_template()
    if "--check" in argv:
        if not TEMPLATE.exists() or TEMPLATE.read_text() != text:
            print(f"{TEMPLATE.relative_to(REPO)} is stale: run scripts/render_admission_policy.py", file=sys.stderr)
            return 1
        return 0
    TEMPLATE.write_text(text)
    print(f"wrote {TEMPLATE.relative_to(REPO)} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
