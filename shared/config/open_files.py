"""The process's open-file limit: raised to the hard limit when a service starts.

A common soft limit is 1,024 descriptors, and a router's HTTP connections, a worker's NATS
link, transport lanes and model files share them: 1,100 idle keep-alive connections pushed the
router to EMFILE (issue 40). The hard limit is what the operator allows; the soft one is only a
default, which a process may raise up to the hard one.
"""

from __future__ import annotations

import contextlib
import resource

# Where the hard limit is unlimited, Linux still refuses a soft limit over fs.nr_open (1,048,576
# by default): ask for that much at most.
MAX_SOFT_LIMIT = 1 << 20


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (at most ``MAX_SOFT_LIMIT``); returns
    (soft, hard) as they are afterwards. A refusal leaves the limit as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_SOFT_LIMIT if hard == resource.RLIM_INFINITY else min(hard, MAX_SOFT_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        # a sandbox that forbids it keeps the old limit, which the caller gets back
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def open_file_limit() -> int:
    """The soft limit on open descriptors now (``MAX_SOFT_LIMIT`` when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_SOFT_LIMIT if soft == resource.RLIM_INFINITY else soft
