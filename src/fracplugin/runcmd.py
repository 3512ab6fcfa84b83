"""``fracplugin run``'s entry: read the settings, set up logging, then run
either the MPS role's keeper or the daemon (``daemon.serve``).

Kept apart from ``daemon.py`` so that the keeper (``--role mps``'s container
main process, ADR 0009, ``mps/keeper.py``) imports only the settings, logging
and the keeper itself, not the doors, ledger, planner and parts the daemon
imports: the keeper lives as long as the MPS role and counts in the node's
memory (issue 28, ``node.rss_mib_split``; docs/benchmarks.md measures it).

Exit status: 0 after an orderly stop, 1 when a part cannot start, 2 for a bad
setting (the keeper: the role process's status).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from . import config as configmod
from . import logs
from .config import ConfigError
from .mps.keeper import KEEPER_ENV

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger("fracplugin.daemon")  # the daemon's log, as before the split

def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``fracplugin run`` (see ``config.add_arguments``)."""
    configmod.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    """``fracplugin run`` (module docstring): returns the exit status."""
    try:
        cfg, sources = configmod.load(args)
        configmod.check_paths(cfg, sources)
    except ConfigError as exc:
        print(f"fracplugin run: {exc}", file=sys.stderr)
        return 2
    logs.setup(cfg.log_format, cfg.log_level)
    for key, closest in configmod.unknown_env(os.environ):
        log.warning("ignored environment variable %s: it names no setting%s", key,
                    f" (did you mean {closest}?)" if closest else "", extra={"variable": key, "closest": closest})
    from .limits import raise_nofile_limit

    raise_nofile_limit()  # soft -> hard: idle clients must not starve the ledger and MPS of descriptors
    if cfg.role == "mps" and os.environ.get(KEEPER_ENV) != "1":
        return keep_mps_role(cfg)
    from .daemon import serve

    return serve(cfg, sources, lambda: configmod.load(args))


def keep_mps_role(cfg: Config | None = None) -> int:
    """``--role mps`` runs as a small keeper process around the real one
    (ADR 0009; ``mps.keeper``): a crash of the role process restarts it in
    place, and a SIGTERM/SIGINT of the keeper (pod deletion) first stops MPS
    on purpose through ``cfg``'s MPS API socket (the daemons get
    ``cfg.shutdown_timeout_s`` seconds), then forwards the signal. Without
    ``cfg`` the quit is skipped. Returns the container's exit status."""
    from .mps.keeper import keep, quit_through_api

    quit_mps = quit_through_api(cfg.effective_mps_api_socket, cfg.shutdown_timeout_s) if cfg is not None else None
    return keep(quit_mps)
