"""Files in places other users of the machine can write (``/dev/shm``, ``/tmp``), never trusted
by their name alone.

A name there is predictable (a run's id is in ``ps``), so another user of a shared machine can make
it first: a directory to receive what a rank writes, a file to be mapped as the notebook's values,
a symlink for a task to truncate what it points at.  Everything a run keeps in such a place lives
in a directory of this user's own (``user_directory``: ``torchdist-<uid>``, mode 0700), checked
before each use (``check_private``: a directory, not a link, owned by this user, no access for
anyone else); and a file a run names is taken only inside the directory it belongs in
(``inside``).

A name of fixed form (``torchdist-<uid>``) can be made first by anyone, for every account: it is
refused, and the run goes on in a private directory of this user's instead
(``usable_user_directory``), which the other processes that must meet there find by a name they
derive from a secret of the run (``agreed``) or are handed; a line says which directory was
refused and which is used, once per process.

A directory of the user's choosing (the history's home) is used only when nobody else can swap
it after its check, as ssh's StrictModes judges a path (``check_ancestors``); what a run reads
back from it, to unpickle above all, is checked on the open descriptor (``open_own``,
``read_own``), never by its name before it is opened.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
import warnings
from typing import Callable, Optional


class UnsafePath(PermissionError):
    """A path a run would use is not this user's own, or not where it belongs."""


class PrivateDirectoryRefused(UserWarning):
    """This user's private directory of its usual name was refused (another user may have made
    it first): a private directory of another name is used instead (``usable_user_directory``)."""


#: the variable that names this user's runtime directory (systemd's ``/run/user/<uid>``): private
#: by its maker's rules, a fallback no other user can make first
RUNTIME_DIR_ENV = "XDG_RUNTIME_DIR"
#: this package's directory inside it
RUNTIME_NAME = "torchdist"
#: the directories refused so far by this process, each said once (``usable_user_directory``)
_refused_said: set = set()
_refused_lock = threading.Lock()


def check_ancestors(path: str) -> str:
    """``path`` (absolute) with the links above its last component resolved, once nobody but
    this user and root can change what it names: every directory above it owned by this user
    or root, and writable by nobody else (a group of this user's alone may write it,
    ``group_is_only_mine``) unless it is root's and sticky (as ``/tmp``): ssh's StrictModes.  ``UnsafePath`` naming the first directory that is not.  Checking the path's
    last component itself is ``check_private``'s; a caller then uses the path returned, whose
    directories nobody else can swap after the check."""
    resolved = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    above = os.path.dirname(resolved)
    ancestors = [above]
    while os.path.dirname(ancestors[-1]) != ancestors[-1]:
        ancestors.append(os.path.dirname(ancestors[-1]))
    for ancestor in reversed(ancestors):  # from / down: the first one wrong is named
        info = os.lstat(ancestor)
        mode = stat.S_IMODE(info.st_mode)
        problems = []
        if not stat.S_ISDIR(info.st_mode):  # a link here was put in since realpath resolved it
            problems.append("not a directory")
        if info.st_uid not in (0, os.geteuid()):
            problems.append(f"owned by uid {info.st_uid}")
        writable = mode & 0o002 or (mode & 0o020 and not group_is_only_mine(info.st_gid))
        if writable and not (info.st_uid == 0 and mode & stat.S_ISVTX):
            problems.append(f"mode {mode:04o}, writable by other users")
        if problems:
            raise UnsafePath(
                f"{ancestor}, a directory above {path}, is {' and '.join(problems)}: another user of "
                "this machine could swap what is below it, so torchdist_magic keeps nothing there. "
                "Every directory above a place it keeps files in must be this user's or root's and "
                "writable by its owner only (or root's and sticky, as /tmp)"
            )
    return resolved


def group_is_only_mine(gid: int) -> bool:
    """Whether group ``gid`` has no member but this user: none listed, and no other account's
    primary group.  A directory writable by such a group is writable by this user only (a user's
    private group, or a single-user container's home, as Jupyter's docker-stacks make it: mode
    2775, group ``users``), as Debian's sshd also judges it."""
    import grp
    import pwd

    me = os.geteuid()
    try:
        group = grp.getgrgid(gid)
        name = pwd.getpwuid(me).pw_name
    except KeyError:  # a group or user the name service does not know: not known to be ours alone
        return False
    if any(member != name for member in group.gr_mem):
        return False
    return all(account.pw_gid != gid or account.pw_uid == me for account in pwd.getpwall())


def open_own(path: str) -> int:
    """``os.open`` of a file a run reads back (read-only, never through a link), checked on the
    open descriptor itself (``fstat``): a regular file of this user's that nobody else may
    write.  ``UnsafePath`` naming what is wrong otherwise: such a file was put there by someone
    else, and is not read (nor, for a pickle, loaded)."""
    fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO does not hold the open
    info = os.fstat(fd)
    problems = []
    if not stat.S_ISREG(info.st_mode):
        problems.append("not a regular file")
    if info.st_uid != os.geteuid():
        problems.append(f"owned by uid {info.st_uid}, not {os.geteuid()}")
    if stat.S_IMODE(info.st_mode) & 0o022:
        problems.append(f"mode {stat.S_IMODE(info.st_mode):04o}, writable by other users")
    if problems:
        os.close(fd)
        raise UnsafePath(
            f"{path} is not a file of this user's own ({', '.join(problems)}): another user of "
            "this machine may have put it there; torchdist_magic will not read it"
        )
    return fd


def read_own(path: str) -> bytearray:
    """The whole of ``path``, opened and checked by ``open_own``, in one ``bytearray`` (read in
    chunks, no copy after)."""
    fd = open_own(path)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        blob = bytearray(os.fstat(fd).st_size)
        view = memoryview(blob)
        got = 0
        while got < len(blob):
            n = fh.readinto(view[got : got + (64 << 20)])
            if not n:  # shorter than it was: what reads it says what is missing
                break
            got += n
        view.release()
    del blob[got:]
    return blob


def check_private(path: str) -> str:
    """``path``, once it is a directory (not a link to one) owned by this user that nobody else
    may enter; ``UnsafePath`` naming what is wrong otherwise."""
    info = os.lstat(path)
    problems = []
    if not stat.S_ISDIR(info.st_mode):
        problems.append("not a directory" if not stat.S_ISLNK(info.st_mode) else "a symbolic link")
    if info.st_uid != os.geteuid():
        problems.append(f"owned by uid {info.st_uid}, not {os.geteuid()}")
    if stat.S_IMODE(info.st_mode) & 0o077:
        problems.append(f"mode {stat.S_IMODE(info.st_mode):04o}, open to other users")
    if problems:
        raise UnsafePath(
            f"{path} is not this user's private directory ({', '.join(problems)}): another "
            "user of this machine may have made it; torchdist_magic will not use it. Remove "
            "it, or point TMPDIR elsewhere"
        )
    return path


def private_directory(path: str) -> str:
    """``path`` made (mode 0700) where it is missing, and checked (``check_private``)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return check_private(path)


def user_path(parent: str) -> str:
    """Where this user's private directory in ``parent`` is (``torchdist-<uid>``)."""
    return os.path.join(parent, f"torchdist-{os.geteuid()}")


def user_directory(parent: str) -> str:
    """This user's private directory in ``parent`` (``user_path``), made and checked."""
    return private_directory(user_path(parent))


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` names an entry of ``directory`` itself (not of a folder below it, not
    through ``..`` or a link to elsewhere)."""
    name = os.path.basename(path)
    return (
        bool(name)
        and name not in (".", "..")
        and os.path.realpath(os.path.dirname(path)) == os.path.realpath(directory)
    )


def open_private(path: str, flags: int) -> int:
    """``os.open`` of a file of a private directory, never through a link (``O_NOFOLLOW``:
    ``UnsafePath`` for one), made readable by this user only when it is created."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(
                f"{path} is a symbolic link where torchdist_magic keeps a file of its "
                "own; it will not follow it. Remove it"
            ) from None
        raise


def usable_user_directory(parent: str, agreed: str = "", say: Optional[Callable[[str], None]] = None) -> str:
    """This user's private directory in ``parent`` (``user_directory``); where that name is
    refused (another user made it first, or a link stands there), a private directory of this
    user's instead, made and checked (``check_private``), and said once per process and refused
    directory: ``say(line)`` where given (a rank's log), else a ``PrivateDirectoryRefused``
    warning.  The fallback is

    - with ``agreed`` (a token that the processes that must meet there derive alike and other
      users cannot: from a run's secret), ``<parent>/torchdist-<uid>-<agreed>``, the same for each
      of them; it is refused in turn only if that token is known to another user;
    - else ``$XDG_RUNTIME_DIR/torchdist`` where that variable names this user's private
      directory (it stays, as the usual one does);
    - else a new directory of ``parent`` (``mkdtemp``: ``torchdist-<uid>-XXXXXXXX``), which the
      caller hands over to the other processes that use it (a run's record names it) and removes
      when done (``remove_fallback``).

    Other failures (``parent`` missing or not writable) are raised as they are."""
    try:
        return user_directory(parent)
    except UnsafePath as exc:
        refused = exc
    if agreed:
        fallback = private_directory(os.path.join(parent, f"{_fallback_prefix()}{agreed}"))
    else:
        runtime = os.environ.get(RUNTIME_DIR_ENV, "")
        fallback = ""
        if os.path.isabs(runtime):
            try:
                fallback = private_directory(os.path.join(check_private(runtime), RUNTIME_NAME))
            except OSError:  # not this user's, not there, or not writable: the next place
                fallback = ""
        if not fallback:
            fallback = tempfile.mkdtemp(prefix=_fallback_prefix(), dir=parent)
    _say_refused(refused, user_path(parent), fallback, say)
    return fallback


def _fallback_prefix() -> str:
    return f"torchdist-{os.geteuid()}-"


def is_fallback(directory: str) -> bool:
    """Whether ``directory`` is a fallback ``usable_user_directory`` made in place of this user's
    usual directory of a parent (``torchdist-<uid>-...``; not ``$XDG_RUNTIME_DIR``'s, which stays)."""
    return os.path.basename(os.path.normpath(directory)).startswith(_fallback_prefix())


def remove_fallback(directory: str) -> None:
    """Remove ``directory`` where it is a fallback (``is_fallback``) that nothing is left in;
    leave it otherwise (the usual directory stays; another process may still use it)."""
    if is_fallback(directory):
        try:
            os.rmdir(directory)
        except OSError:  # gone already, or in use: its last user removes it
            pass


def _say_refused(refused: UnsafePath, usual: str, fallback: str, say: Optional[Callable[[str], None]]) -> None:
    with _refused_lock:
        if usual in _refused_said:
            return
        _refused_said.add(usual)
    line = f"{refused}. Meanwhile it uses {fallback} instead, a private directory of this user's"
    if say is not None:
        say(line)
    else:
        warnings.warn(line, PrivateDirectoryRefused, stacklevel=3)
