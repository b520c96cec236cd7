"""Which failure of a run is its root cause: the earliest that is not merely a peer noticing that
another rank went away (``is_collateral``)."""

from __future__ import annotations

import re
from typing import Iterable, List

from ..core.failure import Failure

#: what a rank raises when a *peer* died: never the root cause while another failure is known
COLLATERAL = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashing|Broken pipe"
    r"|NCCL communicator was aborted|ProcessGroupNCCL.*(watchdog|abort)|recvBytes|sendBytes"
    r"|failed to recv, got 0 bytes|The server socket has failed"
)


def is_collateral(failure: Failure) -> bool:
    return bool(failure.exc_type) and bool(COLLATERAL.search(failure.message))


def root_cause_first(failures: Iterable[Failure]) -> List[Failure]:
    """``failures`` ordered root cause first: the earliest failure that is not merely a peer
    noticing that another rank went away (clocks of different hosts may disagree)."""
    return sorted(failures, key=lambda f: (is_collateral(f), f.time, f.rank))
