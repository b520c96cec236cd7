"""One host relay per machine for a run's launchers (``wire.relay.HostRelay``): the ranks of a
machine reach the driver over one connection.

The launchers of a machine meet in files of this user's private directory of the machine's
temporary directory, named by a token of the run's launcher secret and attempt (``relay_token``:
the run's launchers agree on it, no other user can make it first):

- ``join``: a launcher takes a shared ``flock`` on ``<base>.users`` (held until it leaves; the
  kernel lets it go if the launcher is killed), then ``<base>.lock`` exclusively, and reads
  ``<base>.address``.  Where it names a live launcher's relay, this launcher's rank connects to
  it; where there is none (or its launcher has died), this launcher starts the relay, in its own
  process, and writes its address and pid there: it is the machine's relay's *owner*.
- ``Membership.leave``: a launcher that is not the owner lets go of its shared lock.  The owner
  lets go of its own and waits until it can take the lock exclusively (every other launcher of
  the machine has left), then removes the files under ``<base>.lock`` and closes the relay, which
  sends the driver the last of what its ranks sent.

So the owner's launcher ends only after the machine's other launchers: a Spark task, a Slurm
step or a Ray actor that outlives its own rank by the others' tail.  Where the owner is killed,
the relay goes with it and the machine's other ranks lose their channel, as they would if the
driver went: their launchers report through the backend (``TaskOutcome.channel_lost``); a
launcher that comes later (a rank started late) finds the dead owner's pid and starts a relay
of its own.  The files of a relay whose owner was killed are removed by the last launcher of
the machine to leave, or by the last of their guards (``remote``'s, which is a user of the relay
beside its launcher) where the launchers were killed too.

Whether a run's launchers use a relay is the driver's choice (``RunSpec.host_relay``,
``rankenv.uses_relay``: ``TORCHDIST_HOST_RELAY``).  Where the files cannot be made (no private
directory), a launcher connects to the driver itself, and its rank's log says why.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import tempfile
import time
from typing import Callable, Optional

from ..core.privdir import open_private, usable_user_directory
from ..core.procs import process_exited
from ..core.rankenv import RunSpec
from ..wire.relay import HostRelay

#: how often an owner looks whether the machine's other launchers have left
LEAVE_POLL = 0.05


def relay_token(run: RunSpec) -> str:
    """The name of this attempt of ``run``'s relay files on a machine: derived from the run's
    launcher secret, so the run's launchers agree on it and no other user can make it first."""
    text = f"torchdist host relay {run.run_id} {run.attempt}".encode()
    return hmac.new(run.launcher_secret.encode(), text, hashlib.sha256).hexdigest()[:24]


class Membership:
    """A launcher's place among the users of its machine's relay: ``address`` is where its rank
    connects (without TLS); ``owner`` whether this launcher started the relay."""

    def __init__(self, base: str, users: int, address: str, relay: Optional[HostRelay]):
        #: the path of the relay's files, less their suffix
        self.base = base
        self._users = users
        self.address = address
        self.relay = relay

    @property
    def owner(self) -> bool:
        return self.relay is not None

    def leave(self) -> None:
        """Leave the machine's users; the owner first waits for the others to leave, then
        removes the files and closes the relay.  Idempotent."""
        users, self._users = self._users, -1
        if users < 0:
            return
        try:
            fcntl.flock(users, fcntl.LOCK_UN)
            if self.relay is None:
                return self._last_out(users)
            while True:
                try:
                    fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(LEAVE_POLL)
            lock = open_private(self.base + ".lock", os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                _remove(self.base)
            finally:
                os.close(lock)
            self.relay.close()
        finally:
            os.close(users)

    def _last_out(self, users: int) -> None:
        """A launcher that is not the owner, the last of the machine's to leave where the owner
        was killed (no live pid in the address), removes the relay's files."""
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # the owner, or another launcher, is still there
        if not _live_address(self.base):
            _remove(self.base)


def _remove(base: str) -> None:
    for suffix in (".address", ".users", ".lock"):
        try:
            os.unlink(base + suffix)
        except FileNotFoundError:
            pass


def join(run: RunSpec, rank: int, say: Optional[Callable[[str], None]] = None) -> Membership:
    """Join this machine's relay of ``run`` (see the module's docstring), starting it where
    there is none; ``OSError`` (``privdir.UnsafePath`` too) where its files cannot be made.
    ``say``: where a private directory that another user made first is named
    (``privdir.usable_user_directory``)."""
    directory = usable_user_directory(tempfile.gettempdir(), agreed=relay_token(run), say=say)
    base = os.path.join(directory, f"relay-{relay_token(run)}")
    while True:
        users = open_private(base + ".users", os.O_RDWR | os.O_CREAT)
        fcntl.flock(users, fcntl.LOCK_SH)  # waits only while an owner removes the files
        try:
            same = os.stat(base + ".users").st_ino == os.fstat(users).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(users)  # removed by the owner of an earlier relay: join the next one
    try:
        lock = open_private(base + ".lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            address = _live_address(base)
            if address:
                return Membership(base, users, address, None)
            relay = HostRelay(
                run.channel_address,
                run.secret,
                run.launcher_secret,
                run.run_id,
                [rank],
                world_size=run.num_processes,
                certificate=run.channel_cert,
                others=True,
            )
            try:
                _write_address(base, relay.address)
            except BaseException:
                relay.close()
                raise
            return Membership(base, users, relay.address, relay)
        finally:
            os.close(lock)
    except BaseException:
        os.close(users)
        raise


def _live_address(base: str) -> str:
    """The address in ``<base>.address`` when the launcher that wrote it is alive; ``""``."""
    try:
        fd = open_private(base + ".address", os.O_RDONLY)
    except FileNotFoundError:
        return ""
    try:
        text = os.read(fd, 256).decode("ascii", "replace")
    finally:
        os.close(fd)
    pid, _, address = text.strip().partition(" ")
    if not pid.isdigit() or not address or process_exited(int(pid)):
        return ""
    return address


def _write_address(base: str, address: str) -> None:
    path = base + ".address"
    temporary = f"{path}.{os.getpid()}"
    fd = open_private(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, f"{os.getpid()} {address}\n".encode("ascii"))
    finally:
        os.close(fd)
    os.replace(temporary, path)
