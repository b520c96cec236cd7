"""The backend interface on its own: a third backend needs only ``backends.base``; what
``check`` resolves reaches ``start``; warm pools never stop a pool while holding the registry
lock; caches keyed by a session never take a new session for a dead one."""

import threading
import time
from dataclasses import dataclass

import pytest

from torchdist_magic import Distributor
from torchdist_magic.core import events
from torchdist_magic.backends.base import Backend, BackendRun, LaunchContext, LaunchPlan


class ConstantRun(BackendRun):
    """Every rank 'runs' at once and returns its rank times ten."""

    def __init__(self, ctx: LaunchContext):
        from torchdist_magic.core import values

        self.values = {r: values.dumps(r * 10) for r in range(ctx.spec.num_processes)}
        for r in range(ctx.spec.num_processes):
            ctx.emit(events.Started(rank=r, host="inline", pid=0, time=time.time()))
            ctx.emit(events.Exit(rank=r, code=0, time=time.time(), host="inline"))

    def stop(self, grace):
        pass

    def result(self, rank):
        return self.values[rank]

    def close(self):
        pass


@dataclass(frozen=True)
class InlinePlan(LaunchPlan):
    """What this backend's ``check`` resolves beyond the base plan."""

    where: str = ""


class InlineBackend(Backend):
    """A backend written against ``backends.base`` alone."""

    name = "inline"
    made = []  # every instance the registry made

    def __init__(self):
        self.started_with = None
        InlineBackend.made.append(self)

    def describe(self):
        return "inline"

    def check(self, options):
        return InlinePlan(options.num_processes, where="/resolved/by/check")

    def start(self, ctx):
        self.started_with = ctx.plan
        return ConstantRun(ctx)


@pytest.fixture
def inline_backend():
    from torchdist_magic import register_backend, unregister_backend

    InlineBackend.made.clear()
    register_backend("inline", InlineBackend)
    yield
    unregister_backend("inline")


def test_a_third_backend_needs_only_the_base_class(inline_backend):
    assert Distributor(3, backend="inline", show=None, all_ranks=True).run(print) == [0, 10, 20]
    (backend,) = InlineBackend.made
    assert backend.started_with == InlinePlan(3, where="/resolved/by/check")  # check's plan, in start
    assert backend.slots() is None and backend.slot_owner() is None


def test_a_registered_backend_is_a_name_like_the_built_in_ones(inline_backend):
    from torchdist_magic import LaunchOptions
    from torchdist_magic.core.registry import backend_names

    from torchdist_magic.core.options import option_fields
    from torchdist_magic.panel import control_for

    assert backend_names()[:3] == ("auto", "local", "spark") and "inline" in backend_names()
    assert LaunchOptions(backend="inline").backend == "inline"
    field = next(f for f in option_fields() if f.name == "backend")
    assert "inline" in control_for(field, "auto").options  # the launch panel offers it


def test_a_backend_that_trains_on_no_dataframe_refuses_one(inline_backend):
    import pandas as pd

    with pytest.raises(
        ValueError,
        match="^backend 'inline' does not train on a DataFrame: run it on local "
        r"processes \(a pandas DataFrame\) or on Spark \(a Spark DataFrame\)$",
    ):
        Distributor(2, backend="inline", show=None).train_on_dataframe(print, pd.DataFrame({"x": [1.0, 2.0]}))
    assert InlineBackend.made[0].started_with is None  # refused before anything started


@pytest.mark.parametrize(
    "name,factory,error,text",
    [
        (
            "Bad Name",
            InlineBackend,
            ValueError,
            "a backend's name is lower-case letters, digits, '-' and '_', starting with a letter, got 'Bad Name'",
        ),
        ("local", InlineBackend, ValueError, "backend 'local' is built in and cannot be registered again"),
        ("auto", InlineBackend, ValueError, "backend 'auto' is built in and cannot be registered again"),
        (
            "inline2",
            "not callable",
            TypeError,
            "backend 'inline2': its factory must be callable (a Backend "
            "subclass, or a function returning a Backend), got str",
        ),
    ],
)
def test_a_registration_is_refused_with_why(name, factory, error, text):
    from torchdist_magic import register_backend

    with pytest.raises(error) as info:
        register_backend(name, factory)
    assert str(info.value) == text


def test_a_factory_that_makes_no_backend_is_refused_before_anything_starts():
    from torchdist_magic import register_backend, unregister_backend

    register_backend("not-a-backend", lambda: object())
    try:
        with pytest.raises(
            TypeError,
            match="^backend 'not-a-backend': its factory returned a object, not a "
            r"torchdist_magic Backend \(backends.base.Backend\)$",
        ):
            Distributor(1, backend="not-a-backend", show=None).run(print)
    finally:
        unregister_backend("not-a-backend")


def test_an_installed_backend_comes_from_its_entry_point(tmp_path, monkeypatch):
    """A package declares a backend in the entry point group: it is a name at once, and its
    factory is imported only when a run uses it."""
    import sys

    from torchdist_magic.core.registry import backend_factory, backend_names

    package = tmp_path / "site"
    (package / "tdm_fake_backend").mkdir(parents=True)
    (package / "tdm_fake_backend" / "__init__.py").write_text("def factory():\n    return 'made'\n")
    info = package / "tdm_fake_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tdm-fake-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[torchdist_magic.backends]\nfakecluster = tdm_fake_backend:factory\n")
    monkeypatch.syspath_prepend(str(package))
    assert "fakecluster" in backend_names() and "tdm_fake_backend" not in sys.modules
    assert backend_factory("fakecluster")() == "made"


class LockProbeRun(BackendRun):
    """A warm pool's ranks, already gone.  Stopping them asks, from another thread, for the
    registry lock: what a Spark pool's stop does when it joins the channel's thread, which may
    be waiting for that lock to deliver the rank's ``Exit``."""

    lock_free = None

    def stop(self, grace):
        from torchdist_magic.backends import pool as pools

        def probe():
            got = pools._lock.acquire(timeout=5)
            if got:
                pools._lock.release()
            self.lock_free = got

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()

    def result(self, rank):
        return None

    def close(self):
        pass

    def ranks_alive(self):
        return False


class DeadPoolBackend(Backend):
    name = "dead-pool"

    def __init__(self, owner=None):
        self.owner = owner  # what its slots belong to (a SparkSession)

    def slot_owner(self):
        return self.owner

    def describe(self):
        return "dead pool"

    def start(self, ctx):
        raise AssertionError("never started in this test")


def test_a_dead_pool_is_stopped_outside_the_registry_lock(monkeypatch):
    from torchdist_magic import LaunchOptions
    from torchdist_magic.backends import pool as pools

    options = LaunchOptions(num_processes=1, warm=True)
    old = pools.Pool(options, DeadPoolBackend(), LaunchPlan(1))
    run = old._backend_run = LockProbeRun()
    old.state = "idle"
    monkeypatch.setattr(pools, "make_backend", lambda options: DeadPoolBackend())
    monkeypatch.setattr(pools, "_pools", [old])
    fresh = pools.warm_backend(options)
    try:
        assert run.lock_free is True, "the dead pool was stopped holding the registry lock"
        assert old.state == "stopped" and fresh.fresh and fresh.pool is not old
        assert fresh.note == f"{old.id} stopped: its ranks had died since its last run"
    finally:
        fresh.release()
    assert pools.pools() == []


class Session:
    """Stands for a SparkSession: only its identity matters here."""


def at_a_freed_address(make, use):
    """``(use(first), other)``: ``other``, made by ``make``, lives at the address of ``first``,
    which ``use`` saw and which was then freed (CPython's allocator hands a freed block of the
    same size back at once, most of the time: a hundred tries never all miss)."""
    for _ in range(100):
        first = make()
        seen = use(first)
        address = id(first)
        del first  # no gc.collect(): it would allocate, and take the freed address itself
        other = make()
        if id(other) == address:
            return seen, other
    pytest.fail(
        "the interpreter did not reuse a freed address in 100 tries: this test cannot check what it is about here"
    )


def test_a_pool_placement_never_matches_a_new_session_at_a_dead_ones_address():
    from torchdist_magic import LaunchOptions
    from torchdist_magic.backends import pool as pools

    options = LaunchOptions(num_processes=2, warm=True)
    seen, other = at_a_freed_address(Session, lambda s: pools._placement(options, DeadPoolBackend(s)))
    assert pools._placement(options, DeadPoolBackend(other)) != seen


class ProbedSession:
    """A Connect session's ``range(...).mapInArrow(...).collect()``, run here, counting probes."""

    probes = 0

    def range(self, *args, **kwargs):
        return self

    def mapInArrow(self, function, schema):
        self.function = function
        return self

    def collect(self):
        type(self).probes += 1
        batches = list(self.function(iter([])))
        return [{"facts": batch.column(0)[0].as_py()} for batch in batches]


def test_the_connect_check_is_not_taken_for_a_new_session_at_a_dead_ones_address():
    from torchdist_magic.backends import spark_python

    def check_twice(session):
        spark_python.check_connect_python(session, 1)
        spark_python.check_connect_python(session, 1)
        return ProbedSession.probes

    probes, other = at_a_freed_address(ProbedSession, check_twice)
    spark_python.check_connect_python(other, 1)
    assert ProbedSession.probes == probes + 1  # one probe per session, and this one is new
