"""The backends by name: the four built in, those registered in this process, those installed.

Where a run's ranks go is a name (``backend=``, ``--backend``): ``auto``, ``local``, ``spark``, ``slurm``, ``ray``,
or one a package adds.  A package adds one in either of two ways:

- declared, so that every notebook of the environment has it: an entry point in the group
  ``torchdist_magic.backends`` whose name is the backend's and whose object is its factory
  (``setup.cfg``: ``[options.entry_points] torchdist_magic.backends = slurm = mypkg.slurm:SlurmBackend``);
- in this process: ``torchdist_magic.register_backend("slurm", SlurmBackend)``.

A factory is a callable that takes no argument and returns a ``backends.base.Backend`` (a
subclass of it is one); it may raise ``ValueError`` saying why its backend cannot run here.
This module only knows names and where each factory is: it imports no backend (an option is
checked against the names without starting anything), and ``backends.registry.make_backend``
makes the backend a run uses.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Dict, Tuple

#: the entry point group installed packages declare their backends in
ENTRY_POINT_GROUP = "torchdist_magic.backends"
#: the backend that picks one of the others: Spark where a SparkSession is active, else local
AUTO = "auto"
#: the built-in backends' factories, as ``module:attribute`` (imported only when used)
BUILT_IN = {
    "local": "torchdist_magic.backends.local:LocalProcessBackend",
    "spark": "torchdist_magic.backends.spark:active_session_backend",
    "slurm": "torchdist_magic.backends.slurm:SlurmBackend",
    "ray": "torchdist_magic.backends.ray:RayBackend",
}
_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")
_registered: Dict[str, Callable[[], Any]] = {}


def register_backend(name: str, factory: Callable[[], Any]) -> None:
    """Make ``name`` a backend of this process: ``backend=name`` and ``--backend name`` start
    ranks through ``factory()`` (a ``Backend``).  Registering a name again replaces it; the
    built-in names and ``auto`` cannot be taken.

    Example:

    ```python
    from torchdist_magic import Distributor, register_backend

    register_backend("ssh", SshBackend)          # SshBackend(): a torchdist_magic Backend
    Distributor(num_processes=4, backend="ssh").run(train)   # or %%torchdist --backend ssh
    ```
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"a backend's name is lower-case letters, digits, '-' and '_', starting with a letter, got {name!r}"
        )
    if name == AUTO or name in BUILT_IN:
        raise ValueError(f"backend {name!r} is built in and cannot be registered again")
    if not callable(factory):
        raise TypeError(
            f"backend {name!r}: its factory must be callable (a Backend subclass, or a "
            f"function returning a Backend), got {type(factory).__name__}"
        )
    _registered[name] = factory


def unregister_backend(name: str) -> None:
    """Forget a backend ``register_backend`` added (``KeyError`` for one it did not).

    Example:

    ```python
    from torchdist_magic import unregister_backend

    unregister_backend("ssh")
    ```
    """
    del _registered[name]


def _installed() -> Dict[str, Any]:
    """The entry points of ``ENTRY_POINT_GROUP`` by name (not loaded)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def registered_here(name: str) -> bool:
    """Whether ``name`` is a backend of this process alone (``register_backend``), not installed."""
    return name in _registered and name not in _installed()


def backend_names() -> Tuple[str, ...]:
    """Every name ``backend=`` accepts: ``auto``, the built-in ones, the installed ones, then
    those registered in this process."""
    names = [AUTO, *BUILT_IN]
    for name in [*_installed(), *_registered]:
        if name not in names:
            names.append(name)
    return tuple(names)


def backend_factory(name: str) -> Callable[[], Any]:
    """The factory of backend ``name`` (not ``auto``); ``ValueError`` for a name no backend has,
    listing those there are."""
    if name in BUILT_IN:
        module, _, attribute = BUILT_IN[name].partition(":")
        return getattr(importlib.import_module(module), attribute)
    if name in _registered:
        return _registered[name]
    installed = _installed()
    if name in installed:
        return installed[name].load()
    raise ValueError(unknown_backend(name))


def unknown_backend(name: Any) -> str:
    """What a backend name no backend has is told."""
    return (
        f"backend must be one of {', '.join(backend_names())}, got {name!r} (a package adds one "
        f"with an entry point in the group '{ENTRY_POINT_GROUP}', or register_backend())"
    )
