"""The event channel of a run or a warm pool: its secrets, its TLS key, its server, made in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ..wire.frames import new_secret
from ..wire.server import ChannelServer
from .base import Backend, LaunchPlan


@dataclass
class RunChannel:
    """A listening channel and what its ranks need to reach it (``RunSpec.resolve``)."""

    server: ChannelServer
    secret: str  # the workers' (``rankenv.rank_key(secret, "worker", rank)``)
    launcher_secret: str  # the launchers'
    certificate: str  # the TLS certificate its ranks pin; "" when it is not encrypted

    @property
    def address(self) -> str:
        host, port = self.server.address[:2]
        return f"{host}:{port}"


def open_channel(
    deliver: Callable,
    run_id: str,
    backend: Backend,
    plan: LaunchPlan,
    ranks: int,
    on_refusal: Callable[[str, int, str], None],
    files: Optional[Dict[str, str]] = None,
) -> RunChannel:
    """A new channel for ``ranks`` ranks of ``run_id`` on ``backend``'s address, with secrets
    and (``plan.tls``) a TLS key of its own that never leave this process; ``files``: those it
    serves (``hostcopy``)."""
    secret, launcher_secret = new_secret(), new_secret()
    identity = None
    if plan.tls:
        from ..wire.tls import new_identity

        identity = new_identity()
    server = ChannelServer(
        deliver,
        run_id,
        host=backend.channel_host(),
        secret=secret,
        launcher_secret=launcher_secret,
        identity=identity,
        files=files or {},
        ranks=ranks,
        on_refusal=on_refusal,
    )
    return RunChannel(server, secret, launcher_secret, identity.certificate if identity is not None else "")
