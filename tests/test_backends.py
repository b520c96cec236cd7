"""The backend interface on its own: a third backend needs only ``backends.base``; what
``check`` resolves reaches ``start``; warm pools never stop a pool while holding the registry
lock; caches keyed by a session never take a new session for a dead one."""

import threading
import time

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


class InlineBackend(Backend):
    """A backend written against ``backends.base`` alone."""

    name = "inline"

    def __init__(self):
        super().__init__()
        self.started_with = None

    def describe(self):
        return "inline"

    def check(self, options):
        return LaunchPlan(options.num_processes, python="/resolved/by/check")

    def start(self, ctx):
        self.started_with = ctx.plan
        return ConstantRun(ctx)


def test_a_third_backend_needs_only_the_base_class(monkeypatch):
    import torchdist_magic.driver.distributor as distributor

    backend = InlineBackend()
    monkeypatch.setattr(distributor, "make_backend", lambda options: backend)
    assert Distributor(3, local_mode=True, show=None, all_ranks=True).run(print) == [0, 10, 20]
    assert backend.started_with == LaunchPlan(3, python="/resolved/by/check")  # check's plan, in start
    assert backend.session is None and backend.slots() is None


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
    pytest.fail("the interpreter did not reuse a freed address in 100 tries: this test cannot check "
                "what it is about here")


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
