"""Files in places other users of the machine can write (``/dev/shm``, ``/tmp``), never trusted
by their name alone.

A name there is predictable (a run's id is in ``ps``), so another user of a shared machine can make
it first: a directory to receive what a rank writes, a file to be mapped as the notebook's values,
a symlink for a task to truncate what it points at.  Everything a run keeps in such a place lives
in a directory of this user's own (``user_directory``: ``torchdist-<uid>``, mode 0700), checked
before each use (``check_private``: a directory, not a link, owned by this user, no access for
anyone else); and a file a run names is taken only inside the directory it belongs in
(``inside``).
"""

from __future__ import annotations

import errno
import os
import stat


class UnsafePath(PermissionError):
    """A path a run would use is not this user's own, or not where it belongs."""


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
