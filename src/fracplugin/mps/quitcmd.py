"""``fracplugin mps-quit``: stop MPS on purpose (uninstall, ADR 0009).

The MPS role leaves its control daemons and servers running when it exits
(so that a restart or an upgrade of either role keeps every client's server);
this command is the one thing that stops them: it asks the running MPS role,
through its API socket, to ``quit`` every daemon. Running MPS clients lose
their server. Exit status: 0 done, 1 the MPS role refused or failed, 2 it
could not be reached.
"""

from __future__ import annotations

import argparse
import os
import sys

from .api import MpsError
from .layout import DEFAULT_ROOT

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mps-api-socket", metavar="PATH", default=None,
                   help="the MPS role's API socket (default <mps-root>/api.sock)")
    p.add_argument("--mps-root", metavar="DIR", default=os.environ.get("FRACPLUGIN_MPS_ROOT", DEFAULT_ROOT),
                   help=f"MPS root (default {DEFAULT_ROOT})")
    p.add_argument("--timeout", metavar="SECONDS", type=float, default=10.0,
                   help="seconds the daemons get to quit before they are killed (default 10)")


def main(args: argparse.Namespace) -> int:
    from .rpc import RemoteMps

    path = args.mps_api_socket or os.environ.get("FRACPLUGIN_MPS_API_SOCKET") or os.path.join(args.mps_root, "api.sock")
    remote = RemoteMps(path)
    try:
        remote.quit_daemons(float(args.timeout))
    except (MpsError, ValueError) as e:  # ValueError: the MPS role refused an argument (named in e)
        print(f"fracplugin mps-quit: {e}", file=sys.stderr)
        return 2 if "not reachable" in str(e) else 1
    print(f"MPS daemons stopped (through {path})")
    return 0
