"""The event channel's TLS: the identity made for one run (a key and a self-signed certificate)
and a client's end of a TLS connection (``TlsSocket``).

The driver makes a ``ChannelIdentity`` per run (per attempt; a warm pool one for its life): an
ECDSA P-256 key that never leaves the driver's memory, and a self-signed certificate (PEM) that
travels to every rank in the run's spec.  A rank trusts that certificate and nothing else
(``client_context``): no CA, no host name check, because the exact certificate is the check.
It is exact: the certificate is self-signed and not a CA (``BasicConstraints(ca=False)``, no
``keyCertSign``), so no other certificate verifies against it, not even another one made with
the same key.  Both ends speak TLS 1.3 only: they are the same package, so there is nothing
older to talk to.

``cryptography`` is imported only when an identity is made, so that ``%load_ext`` and a rank
without TLS never load it.
"""

from __future__ import annotations

import datetime
import functools
import os
import secrets
import socket
import ssl
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from .frames import RECV_CHUNK

#: a run's certificate is valid from a day before it is made: executors' clocks may lag the
#: driver's, and the pin, not the dates, is what makes it trustworthy
_CLOCK_SKEW = datetime.timedelta(days=1)
_LIFETIME = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ChannelIdentity:
    """The driver's side of a run's TLS: ``certificate`` (PEM, public: every rank pins it) and
    ``private_key`` (PEM, never sent anywhere)."""

    certificate: str
    private_key: bytes = field(repr=False)

    def server_context(self) -> ssl.SSLContext:
        """A TLS 1.3 server context that presents this identity."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.num_tickets = 0  # no session resumption: a rank connects once per run
        # the ssl module loads keys from files only: an anonymous file in memory (memfd) where
        # the system has one; elsewhere a temporary file holding the key encrypted with a password
        # that never leaves this process, removed as soon as it is loaded
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("torchdist-channel-key", getattr(os, "MFD_CLOEXEC", 0))
            try:
                os.write(fd, self.private_key + self.certificate.encode("ascii"))
                context.load_cert_chain(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            return context
        from cryptography.hazmat.primitives import serialization

        password = secrets.token_bytes(32)
        key = serialization.load_pem_private_key(self.private_key, None).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(password),
        )
        fd, path = tempfile.mkstemp(prefix="torchdist-channel-", suffix=".pem")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(key + self.certificate.encode("ascii"))
            context.load_cert_chain(path, password=password)
        finally:
            os.unlink(path)
        return context


def new_identity() -> ChannelIdentity:
    """A fresh ECDSA P-256 key and a self-signed certificate for it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "torchdist_magic event channel")])
    now = datetime.datetime.now(datetime.timezone.utc)
    public = key.public_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + _LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return ChannelIdentity(
        certificate=certificate.public_bytes(serialization.Encoding.PEM).decode("ascii"),
        private_key=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def client_context(certificate: str) -> ssl.SSLContext:
    """A TLS 1.3 client context that trusts ``certificate`` (PEM) and nothing else."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # the pinned certificate is the check; ranks dial an address
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=certificate)
    return context


class TlsSocket:
    """A client's TLS connection over its blocking socket, done in memory, with what
    ``ChannelClient`` uses of a socket (``sendall``, ``recv``, ``settimeout``, ``shutdown``,
    ``close``).  The sender and the reader thread share it (see ``connection``'s "TLS")."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext):
        self._sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=False)
        self._lock = threading.Lock()  # the TLS object
        self._wire = threading.Lock()  # the socket's write side

    def handshake(self) -> None:
        while True:
            try:
                return self._locked(self._tls.do_handshake)
            except ssl.SSLWantReadError:
                if not self._fill():
                    raise EOFError("connection closed during the TLS handshake") from None

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), RECV_CHUNK):
            self._locked(functools.partial(self._tls.write, view[start : start + RECV_CHUNK]))

    def recv(self, n: int) -> bytes:
        while True:
            data = self._locked(functools.partial(self._plaintext, n))
            if data is not None:
                return data
            if not self._fill():
                with self._lock:
                    self._in.write_eof()

    def recv_into(self, buffer: memoryview) -> int:
        """Plaintext into ``buffer`` (a fetch's reused buffer); 0 at the end."""
        while True:
            data = self._locked(functools.partial(self._plaintext, len(buffer), buffer))
            if data is not None:
                return data
            if not self._fill():
                with self._lock:
                    self._in.write_eof()

    def _plaintext(self, n: int, buffer: Optional[memoryview] = None) -> Optional[Union[bytes, int]]:
        """Up to ``n`` bytes of plaintext; ``None`` when more ciphertext is needed first."""
        try:
            return self._tls.read(n) if buffer is None else self._tls.read(n, buffer)
        except ssl.SSLWantReadError:
            return None
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # closed, with or without TLS's goodbye
            return b"" if buffer is None else 0

    def _fill(self) -> bool:
        """Read ciphertext from the socket into TLS; False at the end of the connection."""
        data = self._sock.recv(RECV_CHUNK)
        if data:
            with self._lock:
                self._in.write(data)
        return bool(data)

    def _locked(self, operation: Callable):
        """``operation()`` on the TLS object, then send what it wrote (also when it raised):
        the write side is taken before the TLS lock is let go, so records leave in the order
        they were made, and the TLS object is free again while the socket sends."""
        out = b""
        try:
            with self._lock:
                try:
                    return operation()
                finally:
                    out = self._out.read()
                    if out:
                        self._wire.acquire()
        finally:
            if out:
                try:
                    self._sock.sendall(out)
                finally:
                    self._wire.release()

    def settimeout(self, timeout: Optional[float]) -> None:
        self._sock.settimeout(timeout)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()
