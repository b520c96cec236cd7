"""The channel's handshake, both ends: a rank's connection to the driver (``open_connection``:
the challenge answered, the driver's proof checked) and the driver's check of a hello
(``check_hello``).  The frames and proofs they exchange are ``frames``'s.

A handshake the driver cut off, or one that took too long, is tried again with a jittered,
growing pause (``open_connection``), so that ranks connecting all at once (2,048 connections for
1024 ranks) all get in.
"""

from __future__ import annotations

import random
import secrets
import socket
import ssl
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

from ..core import events
from ..core.rankenv import rank_key
from ..core.timing import HANDSHAKE_DEADLINE
from . import framemac
from .frames import (
    MAX_HELLO,
    FrameError,
    NotTheDriver,
    Refused,
    hello_mac,
    hello_proof,
    macs_equal,
    pack_frame,
    read_frame,
)
from .tls import TlsSocket

if TYPE_CHECKING:
    from .transfers import FileTransfers

#: a rank's handshake cut off (a flood of strangers evicted it) or not done in time (a driver
#: busy with many) is tried again after this pause, doubling, each pause drawn between half and
#: one and a half of it so that ranks evicted together do not come back together; for at most
#: ``CONNECT_ATTEMPTS`` times ``HANDSHAKE_DEADLINE`` in all
_RETRY_PAUSE, _RETRY_PAUSE_MAX = 0.05, 2.0
CONNECT_ATTEMPTS = 6


def open_connection(
    address: Tuple[str, int],
    secret: str,
    run_id: str,
    rank: int,
    role: str,
    context: Optional[ssl.SSLContext] = None,
    fetch: str = "",
    upload: Optional[int] = None,
    ranks: Optional[List[int]] = None,
) -> Union[framemac.MacSocket, TlsSocket]:
    """An authenticated connection to the driver at ``address`` as ``role`` of ``rank`` (TLS
    with ``context``; ``fetch``: to fetch the file of that name; ``upload``: to send the rank's
    value of that many bytes; see ``transfers``; ``ranks``: a host relay's ranks, see
    ``relay``): each
    handshake within ``HANDSHAKE_DEADLINE``; one that the driver cut off (evicted from its
    pending table) or that took too long is tried again after a jittered, growing pause, for at most ``CONNECT_ATTEMPTS`` times ``HANDSHAKE_DEADLINE``.  Raises
    ``Refused``, ``NotTheDriver``, ``FrameError``, ``EOFError`` or ``OSError`` (``TimeoutError``
    too)."""
    started = time.monotonic()
    give_up = started + CONNECT_ATTEMPTS * HANDSHAKE_DEADLINE
    pause = _RETRY_PAUSE
    while True:
        attempt = time.monotonic()
        try:
            return _handshake(
                address,
                secret,
                run_id,
                rank,
                role,
                context,
                min(attempt + HANDSHAKE_DEADLINE, give_up),
                fetch,
                upload,
                ranks,
            )
        except (
            EOFError,
            ConnectionResetError,
            BrokenPipeError,
            TimeoutError,
            socket.timeout,
        ) as exc:  # 3.9: not the same
            wait = pause * random.uniform(0.5, 1.5)
            if time.monotonic() + wait >= give_up:
                if isinstance(exc, (TimeoutError, socket.timeout)):  # a read's own says only "timed out"
                    raise TimeoutError(f"no handshake within {HANDSHAKE_DEADLINE:g} s") from exc
                raise
            time.sleep(wait)
            pause = min(2 * pause, _RETRY_PAUSE_MAX)


def _handshake(
    address: Tuple[str, int],
    secret: str,
    run_id: str,
    rank: int,
    role: str,
    context: Optional[ssl.SSLContext],
    deadline: float,
    fetch: str = "",
    upload: Optional[int] = None,
    ranks: Optional[List[int]] = None,
) -> Union[framemac.MacSocket, TlsSocket]:
    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no handshake within {HANDSHAKE_DEADLINE:g} s")
        return remaining

    plain = socket.create_connection(address, timeout=left())
    sock: Union[socket.socket, framemac.MacSocket, TlsSocket] = plain
    try:
        if context is not None:
            sock = secure = TlsSocket(plain, context)
            try:
                secure.handshake()
            except ssl.SSLCertVerificationError as exc:
                raise NotTheDriver(
                    f"its TLS certificate is not the one this run pinned ({exc.verify_message})"
                ) from None
            sock.settimeout(left())
        nonce = read_frame(sock, MAX_HELLO).get("nonce")
        if not isinstance(nonce, str):
            raise FrameError("the driver sent no challenge")
        own_nonce = secrets.token_hex(16)
        sock.settimeout(left())
        hello = {
            "nonce": own_nonce,
            "run_id": run_id,
            "rank": rank,
            "role": role,
            "protocol": events.PROTOCOL_VERSION,
        }
        if fetch:
            hello["fetch"] = fetch
        if upload is not None:
            hello.update(upload=rank, size=upload)
        if ranks is not None:
            hello["ranks"] = list(ranks)
        hello["mac"] = hello_proof(secret, nonce, hello)
        sock.sendall(pack_frame(hello))
        sock.settimeout(left())
        reply = read_frame(sock, MAX_HELLO)
        if reply.get("ok") is not True:
            raise Refused(f"{reply.get('error', 'no reason given')!s:.500}")
        if not macs_equal(reply.get("mac"), hello_mac(secret, own_nonce)):
            raise Refused("it could not prove that it knows this run's secret")
        if context is None:  # no TLS: every byte from here on in authenticated records
            sock = framemac.MacSocket(plain, framemac.session_key(secret, nonce, own_nonce))
        sock.settimeout(None)
        assert not isinstance(sock, socket.socket)  # one of the two above
        return sock
    except BaseException:
        sock.close()
        raise


def check_hello(
    hello: dict,
    challenge: str,
    *,
    run_id: str,
    ranks: Optional[int],
    role_secrets: Dict[str, str],
    files: "FileTransfers",
) -> Optional[str]:
    """Why ``hello`` (answering the nonce ``challenge``) does not open the channel of run
    ``run_id`` of ``ranks`` ranks (``None``: any number), whose roles have ``role_secrets``,
    serving ``files``; ``None`` when it does."""
    protocol = hello.get("protocol")
    if type(protocol) is not int or protocol != events.PROTOCOL_VERSION:
        return (
            f"event protocol version mismatch: the rank speaks version {protocol!r:.20}, "
            f"the driver speaks version {events.PROTOCOL_VERSION}; the driver and the "
            "executors need the same torchdist_magic version"
        )
    role = hello.get("role")
    if not isinstance(role, str) or role not in role_secrets:
        return f"unknown role {role!r:.20}"
    rank, nonce = hello.get("rank"), hello.get("nonce")
    if type(rank) is not int or rank < 0 or not isinstance(nonce, str):
        return "a hello needs a rank and a nonce"
    if ranks is not None and rank >= ranks:
        return f"rank {rank} is not a rank of this run, which has {ranks}"
    proof = hello_proof(rank_key(role_secrets[role], role, rank), challenge, hello)
    if proof is None or not macs_equal(hello.get("mac"), proof.encode()):
        return f"authentication failed: wrong secret for role {role} of rank {rank}"
    if hello.get("run_id") != run_id:
        return f"wrong run: this channel serves run {run_id}"
    if role == "relay" or "ranks" in hello:
        reason = relay_ranks_problem(hello, role, rank, ranks)
        if reason is not None:
            return reason
    fetch = hello.get("fetch")
    if fetch is not None and role != "launcher":  # a worker's key fetches nothing (workers never do)
        return "only a rank's launcher fetches files"
    if fetch is not None and not files.serves(fetch):
        return f"this channel serves no file named {fetch!r:.100}"
    if "upload" in hello:
        size = hello.get("size")
        if role != "launcher" or type(hello["upload"]) is not int or hello["upload"] != rank or fetch is not None:
            return "only a rank's launcher uploads, and only its own rank's value"
        if type(size) is not int or size < 0:
            return "an upload needs the value's size"
        if not files.takes_value(rank):
            return f"this channel waits for no value from rank {rank}"
    return None


#: the most ranks one host relay speaks for (its hello names them all, within ``MAX_HELLO``)
MAX_RELAY_RANKS = 256


def relay_ranks_problem(hello: dict, role: str, rank: int, ranks: Optional[int]) -> Optional[str]:
    """Why a hello's ``"ranks"`` (a host relay's: the ranks of its host, ``relay``) do not open
    the channel; ``None`` when they do.  A relay authenticates as the first of its ranks and
    names them all; no other role names ranks, and a relay fetches and uploads nothing."""
    named = hello.get("ranks")
    if role != "relay":
        return "only a host relay names ranks"
    if "fetch" in hello or "upload" in hello:
        return "a host relay fetches and uploads nothing"
    if (
        not isinstance(named, list)
        or not named
        or len(named) > MAX_RELAY_RANKS
        or any(type(r) is not int or r < 0 or (ranks is not None and r >= ranks) for r in named)
        or len(set(named)) != len(named)
        or min(named) != rank
    ):
        return (
            f"a host relay names its ranks: from 1 to {MAX_RELAY_RANKS} different ranks of this run, "
            "the first of them the rank it authenticates as"
        )
    return None
