"""Process resource limits of the daemon (issue 13 item 1).

A container gets the runtime's ``RLIMIT_NOFILE``; containerd and CRI-O
commonly start containers with a soft limit of 1024 and a much higher hard
limit (containerd's default ``LimitNOFILE`` for its children; Go raises its
own soft limit but not the children's). The daemon holds one descriptor per
client connection, per MPS control daemon pipe and per ledger write, so it
raises its soft limit to the hard limit at start, which an unprivileged
process may always do (setrlimit(2): "an unprivileged process may set only
its soft limit to a value in the range from 0 up to the hard limit").

Concurrency: call once from the main thread before any part starts.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

NR_OPEN_PATH = "/proc/sys/fs/nr_open"


def _nr_open(path: str = NR_OPEN_PATH) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (to
    ``/proc/sys/fs/nr_open`` when the hard limit is unlimited: Linux refuses a
    soft limit above it). Returns the (soft, hard) limits in effect afterwards
    (file descriptors). Never raises: a refused ``setrlimit`` is logged and
    the old limits are returned."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = _nr_open() or soft
    if soft != resource.RLIM_INFINITY and target != resource.RLIM_INFINITY and soft >= target:
        log.info("open-file limit %d (hard %s): nothing to raise", soft, hard)
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
        return soft, hard
    log.info("open-file limit raised from %d to %d (the hard limit)", soft, target)
    return target, hard
