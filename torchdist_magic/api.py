"""The Python API: ``Distributor(...).run(train_object, *args)``.

Call-compatible with ``pyspark.ml.torch.distributor.TorchDistributor``: ``num_processes``,
``local_mode``, ``use_gpu``, and ``run`` taking a function (run as ``fn(*args, **kwargs)`` on
every rank) or a path to a ``.py`` file (run as a script with ``args`` as its command line).
Unlike TorchDistributor it always returns rank 0's value, turns any rank's failure into a
``RankFailure`` with that rank's traceback, and never leaves a process behind.
"""

from __future__ import annotations

from typing import Any, Optional

from .handles.attach import supervised
from .driver.console import stdin_available
from .driver.distributor import Run, submit
from .handles.follow import follow
from .core.options import LaunchOptions

SHOW_CHOICES = ("text", "auto", "widget", None)


class _LocalModeDefault:
    """The type of ``LOCAL_MODE_DEFAULT``: one instance, whose repr is its public name (what
    ``help(Distributor)`` and the reference show as ``local_mode``'s default)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LOCAL_MODE_DEFAULT"


#: ``local_mode``'s default: ``True`` (local processes, TorchDistributor's default) unless
#: ``backend=`` names a backend, which then decides alone.  Telling "left out" from an explicit
#: ``True`` is what lets ``Distributor(backend="spark")`` work while ``local_mode=True,
#: backend="spark"`` is refused as a contradiction.
LOCAL_MODE_DEFAULT: Any = _LocalModeDefault()


def _backend_for(local_mode: Any, backend: Optional[str]) -> str:
    """The backend that ``local_mode`` and ``backend`` ask for together; refuses a contradiction."""
    if local_mode is LOCAL_MODE_DEFAULT:
        return "local" if backend is None else backend
    if local_mode is not None and not isinstance(local_mode, bool):
        raise TypeError(f"local_mode must be True, False or None, got {local_mode!r}")
    implied = "auto" if local_mode is None else ("local" if local_mode else "spark")
    if backend is not None and backend != implied:
        raise ValueError(f"local_mode={local_mode} and backend={backend!r} contradict each other: give one of them")
    return implied


class Distributor:
    """Run a function or a script as ``num_processes`` ranks of distributed PyTorch.

    ``Distributor(num_processes=1, local_mode=True, use_gpu=False, **options)``:
    ``local_mode=True`` runs local processes on this machine, ``local_mode=False`` a Spark
    barrier stage on the active SparkSession, ``local_mode=None`` picks Spark when a session is
    active; left out (``LOCAL_MODE_DEFAULT``) it is ``True`` unless ``backend=`` names the
    backend, so ``Distributor(4, backend="spark")`` needs no ``local_mode``.  The other keywords are ``LaunchOptions`` fields (``timeout``, ``env``,
    ``all_ranks``, ``backend``).  ``show`` picks the live view of ``run``: ``"text"`` (default),
    ``"auto"`` (the widget in a Jupyter kernel with ipywidgets, text elsewhere), ``"widget"``,
    or ``None`` for silence.

    Example:

    ```python
    from torchdist_magic import Distributor

    def train(lr):
        import torch.distributed as dist
        dist.init_process_group("gloo")      # as under TorchDistributor
        ...                                  # train with lr
        return dist.get_rank(), dist.get_world_size()

    Distributor(num_processes=2).run(train, 0.01)   # local processes; rank 0's value: (0, 2)
    Distributor(num_processes=8, local_mode=False, use_gpu=True, timeout=3600).run(train, 0.01)  # Spark
    ```
    """

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: Optional[bool] = LOCAL_MODE_DEFAULT,
        use_gpu: bool = False,
        *,
        show: Optional[str] = "text",
        **options: Any,
    ):
        known = [name for name in LaunchOptions.__dataclass_fields__ if name not in ("num_processes", "use_gpu")]
        unknown = set(options) - set(known)
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}; known: {', '.join(known)}")
        backend = _backend_for(local_mode, options.pop("backend", None))
        self.options = LaunchOptions(num_processes=num_processes, use_gpu=use_gpu, backend=backend, **options)
        self.show = _checked_show(show)

    @classmethod
    def from_options(cls, options: LaunchOptions, show: Optional[str] = "text") -> "Distributor":
        """A Distributor for an existing ``LaunchOptions``, validated like the constructor's."""
        if not isinstance(options, LaunchOptions):
            raise TypeError(f"options must be a LaunchOptions, got {type(options).__name__}")
        self = cls.__new__(cls)
        self.options = options.replace()
        self.show = _checked_show(show)
        return self

    @property
    def num_processes(self) -> int:
        """How many ranks a run starts (``--np``)."""
        return self.options.num_processes

    @property
    def local_mode(self) -> bool:
        """True when the ranks run as local processes (``backend="local"``), as TorchDistributor's
        ``local_mode``; False for Spark and for ``"auto"`` (``local_mode=None``)."""
        return self.options.backend == "local"

    @property
    def use_gpu(self) -> bool:
        """True when each rank gets one GPU and the nccl process group (``--gpu``)."""
        return self.options.use_gpu

    def submit(self, train_object: Any, *args: Any, **kwargs: Any) -> Run:
        """Start the run and return its ``Run`` handle at once (with ``detach=True`` a detached
        run's handle, ``attach.AttachedRun``)."""
        if supervised(self.options):
            return self._detached(train_object, args, kwargs)
        return submit(train_object, args, kwargs, self.options)

    def run(self, train_object: Any, *args: Any, **kwargs: Any) -> Any:
        """Run and wait; rank 0's value.  Ctrl-C stops every rank and re-raises.  A rank's
        debugger (``breakpoint()``, ``pdb=True``) opens here when this thread can read input
        (a notebook with stdin, a terminal).  With ``detach=True`` nothing waits: the run's
        handle is returned once it started (``torchdist_magic.attach(run_id)`` finds it again
        from any process of this machine)."""
        if self.options.detach:
            return self._detached(train_object, args, kwargs)
        if supervised(self.options):  # channel="process": its channel off this kernel
            return self._follow_own(self._detached(train_object, args, kwargs))
        return self._follow(submit(train_object, args, kwargs, self.options, debug_input=stdin_available()))

    def _detached(self, train_object: Any, args: tuple, kwargs: dict, data: Any = None) -> Any:
        from .handles.attach import submit_detached

        return submit_detached(train_object, args, kwargs, self.options, data=data)

    def train_on_dataframe(self, train_function: Any, spark_dataframe: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_function(*args, **kwargs)`` on every rank, each rank reading its own share
        of ``spark_dataframe``'s rows with ``torchdist_magic.shard(batch_size=...)``; wait, and
        return rank 0's value (the call of TorchDistributor's ``_train_on_dataframe``).

        On Spark (``local_mode=False``) the rows go from the executors straight to the ranks
        they run, never through this process: any partition count works (the DataFrame is
        repartitioned into one partition per rank).  On local processes give a pandas DataFrame
        (split by rows).  Every column travels: ``select`` the ones the job needs first.  A
        DataFrame that cannot be trained on (empty, fewer rows than ranks, columns that cannot
        become tensors, another SparkSession's) raises ``TypeError``/``ValueError`` before
        anything starts."""
        if self.options.detach:
            return self._detached(train_function, args, kwargs, data=spark_dataframe)
        if supervised(self.options, spark_dataframe):  # channel="process": refused with a DataFrame
            return self._follow_own(self._detached(train_function, args, kwargs, data=spark_dataframe))
        return self._follow(
            submit(train_function, args, kwargs, self.options, data=spark_dataframe, debug_input=stdin_available())
        )

    #: TorchDistributor's private name for it, which code written for TorchDistributor calls
    _train_on_dataframe = train_on_dataframe

    def _follow_own(self, run: Any) -> Any:
        from .handles.attach import follow_attached

        from .view import make_view

        show = self.show
        return follow_attached(run, own=True, make_observer=None if show is None else lambda: make_view(run, show))

    def _follow(self, run: Run) -> Any:
        observer = None
        if self.show is not None:
            from .view import make_view

            observer = make_view(run, self.show)
        return follow(run, observer)


def _checked_show(show: Any) -> Optional[str]:
    if show not in SHOW_CHOICES:
        raise ValueError(f"show must be one of {', '.join(map(repr, SHOW_CHOICES))}, got {show!r}")
    return show
