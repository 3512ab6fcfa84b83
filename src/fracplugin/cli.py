"""``fracplugin`` command line: run | explain | status | demo | mps-quit | version.

Each subcommand lives in its own module with ``add_arguments(parser)`` and
``main(args) -> int``; this file only dispatches, so ``fracplugin explain``
does not import the door's gRPC library (grpcio, loaded only where the
device plugin door runs: ADR 0016, 0021) and ``fracplugin run`` does not
import the demo (``fracplugin_demo``, a sibling package: a tool, not a door).
Exit status: 0 success, 1 refusal/failure, 2 usage error (argparse's own).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

# subcommand -> (module, help)
SUBCOMMANDS = {
    "run": ("fracplugin.runcmd", "run the node daemon (NRI plugin, device plugin, MPS supervisor, metrics)"),
    "explain": ("fracplugin.explain", "show what each container of a pod would get on a node, or why it is refused"),
    "status": ("fracplugin.status", "show the running daemon's GPUs, tenants, MPS daemons and readiness"),
    "demo": ("fracplugin_demo.demo", "run the daemon on a simulated node and drive it through both doors"),
    "mps-quit": ("fracplugin.mps.quitcmd", "stop the MPS control daemons on purpose, through the MPS role (uninstall)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (all when None), so a
    broken or heavy subcommand never affects another."""
    parser = argparse.ArgumentParser(prog="fracplugin", description="fracplugin: the node half of memory-enforced GPU sharing on Kubernetes.")
    parser.add_argument("--version", action="version", version=f"fracplugin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if command is not None and name != command:
            continue
        try:
            importlib.import_module(module).add_arguments(p)
        except ImportError as exc:  # a door not built into this install
            p.set_defaults(_missing=str(exc))
    v = sub.add_parser("version", help="print the version")
    v.set_defaults(_module=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = build_parser(command or "")
    args = parser.parse_args(argv)
    if args.command == "version":
        print(f"fracplugin {__version__}")
        return 0
    if getattr(args, "_missing", None):
        print(f"fracplugin {args.command}: not available: {args._missing}", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
