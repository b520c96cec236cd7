"""The view's feed (supervise/feed.py, handles/feed.py): a run's state read from the process that holds it, over a
real Unix socket in this user's private directory, against a real ``RunState`` fed records."""

import os
import socket
import threading

import pytest

from torchdist_magic.core import events
from torchdist_magic.core.privdir import user_directory
from torchdist_magic.driver.reading import FACTS
from torchdist_magic.handles.feed import FedMergedLog, HostedState
from torchdist_magic.supervise.feed import ANSWER, FeedServer
from torchdist_magic.driver.merged import MergedLog
from torchdist_magic.driver.state import RunState

TOKEN = "feed-test-token"


def fed_state(ranks=3):
    state = RunState("feed-run", ranks, "local processes")
    for rank in range(ranks):
        state.apply(events.Started(rank=rank, host="h", pid=100 + rank))
        for step in range(1, 6):
            state.apply(events.Metrics.point(rank, step, {"loss": 1.0 / step}, float(step)))
            state.apply(events.Log(rank=rank, stream="stdout", line=f"rank {rank} step {step}"))
    return state


@pytest.fixture
def socket_path(tmp_path):
    path = os.path.join(user_directory(str(tmp_path)), "feed.sock")
    yield path
    if os.path.lexists(path):
        os.unlink(path)


@pytest.fixture
def served(socket_path):
    state = fed_state()
    stops = []
    server = FeedServer(socket_path, TOKEN, state, stops.append)
    yield state, server, stops
    server.close()


def never(_=None):
    raise AssertionError("the fallback was not to be used while the feed serves")


def test_reads_through_the_feed_are_the_states_own(served, socket_path):
    state, server, _ = served
    hosted = HostedState(socket_path, TOKEN, 3, never)
    snap = hosted.snapshot()
    assert snap.run_id == "feed-run" and [rs.pid for rs in snap.ranks] == [100, 101, 102]
    assert snap.ranks == state.snapshot().ranks
    assert hosted.snapshot(snap.version).changed == frozenset()
    assert hosted.read_log(1, start=3).lines == state.read_log(1, start=3).lines
    assert [line.text for line in hosted.recent_log(2, 2).lines] == ["rank 2 step 4", "rank 2 step 5"]
    assert hosted.metric_history(points=2, ranks=[0]) == state.metric_history(points=2, ranks=[0])
    assert hosted.logs(0) == state.logs(0)
    reads = [(0, 2, None, False), (2, 0, 2, True)]
    assert [got.lines for got in hosted.read_logs(reads)] == [got.lines for got in state.read_logs(reads)]
    assert [line.text for line in hosted.read_logs(reads)[1].lines] == ["rank 2 step 4", "rank 2 step 5"]
    every = [(rank, 0, None, False) for rank in range(3)]
    budgeted = hosted.read_logs(every, budget=6)  # 5 lines a rank: the third is not read
    assert [None if got is None else len(got.lines) for got in budgeted] == [5, 5, None]
    assert hosted.failures() == [] and hosted.running() == [0, 1, 2]
    view = hosted.large_view(host="h", rank=None)  # worked out where the state is
    assert view.overview == state.large_view().overview and view.page == [0, 1, 2]
    assert view.snap.ranks == () and view.shown == {rs.rank: rs for rs in snap.ranks}
    assert hosted.large_view(host="h", rank=1).page == [1]
    assert hosted.state == state.state and hosted.started == state.started and not hosted.finished
    assert hosted.facts() == {name: getattr(state, name) for name in FACTS}  # one read, every fact
    assert server.readers() == 1 and hosted.hosted
    hosted.close()
    assert server.linger(5.0)


def test_a_reads_error_is_raised_in_the_kernel(served, socket_path):
    hosted = HostedState(socket_path, TOKEN, 3, never)
    with pytest.raises(IndexError, match="rank 7 is not in this run"):
        hosted.read_log(7)
    with pytest.raises(IndexError, match="rank 3 is not in this run"):
        hosted.read_logs([(0, 0, None, False), (3, 0, None, False)])
    with pytest.raises(AttributeError, match="'HostedState' object has no attribute 'no_such'"):
        hosted.no_such  # noqa: B018 - no read is asked for a name the table does not declare
    assert hosted.snapshot().num_processes == 3  # the connection goes on after an error
    hosted.close()


def test_a_wrong_token_is_refused(served, socket_path):
    hosted = HostedState(socket_path, "not-the-token", 3, never)
    with pytest.raises(PermissionError, match="refused a read: not the run's token"):
        hosted.snapshot()


def test_an_unknown_read_is_refused(served, socket_path):
    hosted = HostedState(socket_path, TOKEN, 3, never)
    with pytest.raises(
        PermissionError, match="the process that holds the run's state refused a read: no read 'nothing'"
    ):
        hosted._ask("nothing")
    hosted.close()


def test_stop_takes_the_runs_token(served, socket_path):
    _, _, stops = served

    def send(record):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(socket_path)
            conn.sendall((events.dumps(record) + "\n").encode())
            return conn.recv(64)

    assert send(events.StopRun(rank=-1, token="wrong", by="x")) == b"refused\n" and stops == []
    assert send(events.StopRun(rank=-1, token=TOKEN, by="a test")) == b"ok\n" and stops == ["a test"]


def test_once_the_holder_has_gone_reads_go_to_the_fallback(socket_path):
    state = fed_state()
    server = FeedServer(socket_path, TOKEN, state, lambda by: None)
    rebuilt = []

    def fallback():
        local = fed_state()
        local.finish("succeeded")
        rebuilt.append(local)
        return local

    hosted = HostedState(socket_path, TOKEN, 3, fallback)
    assert not hosted.finished and hosted.hosted
    server.close()  # the supervising process ended: its socket is gone
    hosted.close()
    assert hosted.finished and not hosted.hosted and len(rebuilt) == 1
    assert hosted.logs(2) == state.logs(2) and hosted.snapshot().ranks == rebuilt[0].snapshot().ranks
    assert len(rebuilt) == 1  # made once


def test_without_a_socket_the_fallback_is_read():
    hosted = HostedState(None, "", 3, fed_state)
    assert hosted.snapshot().num_processes == 3 and not hosted.hosted


def test_linger_waits_for_a_reader_that_stays_quiet(served, socket_path):
    _, server, _ = served
    hosted = HostedState(socket_path, TOKEN, 3, never)
    hosted.snapshot()
    assert not server.linger(0.2, quiet=10.0)  # a reader that read just now, its feed open
    assert server.linger(5.0, quiet=0.3)  # quiet for long enough: its view took its last look
    done = threading.Event()
    threading.Thread(target=lambda: (server.linger(30.0, quiet=30.0), done.set()), daemon=True).start()
    hosted.close()
    assert done.wait(10.0)  # the reader closed its feed


def test_facts_are_attributes_of_the_state():
    state = fed_state()
    assert all(hasattr(state, name) for name in FACTS)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a process of another user that listens")
def test_a_socket_another_user_listens_on_is_not_read():
    import tempfile

    from helpers import wait_until

    directory = tempfile.mkdtemp(dir="/tmp")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "feed.sock")
    child = os.fork()
    if child == 0:  # another user's process that listens where a run's socket would be
        try:
            os.setuid(65534)
            listener = socket.socket(socket.AF_UNIX)
            # bound under another name and listening before it takes the run's name: a connect
            # between bind and listen is refused, and the read would rightly go to the fallback
            listener.bind(path + ".new")
            listener.listen(1)
            os.rename(path + ".new", path)
            listener.accept()[0].recv(100)
        finally:
            os._exit(0)
    try:
        wait_until(lambda: os.path.exists(path), 30, "the other user's socket")
        hosted = HostedState(path, TOKEN, 1, never)
        with pytest.raises(PermissionError, match=r"feed.sock is not this user's: the run's state is not read from it"):
            hosted.snapshot()
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
        os.unlink(path)
        os.rmdir(directory)


def test_metric_points_read_through_the_feed_come_once(socket_path):
    from torchdist_magic.driver.reading import MetricCursor

    state = fed_state(ranks=2)
    server = FeedServer(socket_path, TOKEN, state, lambda by: None)
    hosted = HostedState(socket_path, TOKEN, 2, fed_state)
    cursor = MetricCursor()
    first = hosted.metric_points(cursor)
    assert [step for step, _ in first["loss"][1]] == [1, 2, 3, 4, 5]
    assert cursor.read == {}  # the place is kept by the process that holds the state
    state.apply(events.Metrics.point(1, 6, {"loss": 0.1}, 6.0))
    assert hosted.metric_points(cursor) == {"loss": {1: [(6, 0.1)]}}
    assert hosted.metric_points(cursor) == {}
    hosted.close()
    assert hosted.metric_points(cursor) == {}  # the feed opened again: the place was kept
    server.close()
    assert hosted.metric_points(cursor) == {}  # gone: the run ended and its points were read
    fresh = hosted.metric_points(MetricCursor())  # a new reader reads the state rebuilt here
    assert [step for step, _ in fresh["loss"][0]] == [1, 2, 3, 4, 5] and not hosted.hosted


def test_a_kernels_merged_log_is_kept_where_the_state_is_and_only_its_news_come(socket_path):
    state = fed_state()
    server = FeedServer(socket_path, TOKEN, state, lambda by: None)
    rebuilt = []

    def fallback():
        rebuilt.append(fed_state())
        return rebuilt[-1]

    hosted = HostedState(socket_path, TOKEN, 3, fallback)
    fed, local = FedMergedLog(3, limit=6), MergedLog(3, limit=6)
    try:
        assert fed.drain(hosted) and local.drain(state)
        assert fed.shown() == local.shown() and len(fed.lines) == 6  # the newest 6 of 15 lines
        assert fed.pending == 0 and not fed.drain(hosted)  # nothing new: nothing comes
        state.apply(events.Log(rank=1, stream="stderr", line="RuntimeError: boom"))
        state.apply(events.Log(rank=2, line="epoch 1 50%", cr=True))  # a bar in progress
        assert fed.drain(hosted) and local.drain(state)
        assert fed.shown() == local.shown() and fed.shown()[-1] == (2, local.live[2])
        assert list(fed.problems) == list(local.problems) == [(1, local.lines[-1][1])]
        state.apply(events.Log(rank=2, line="epoch 1 done"))  # the bar's line is replaced
        assert fed.drain(hosted) and fed.live[2] is None and fed.lines[-1][1].text == "epoch 1 done"
        first = hosted.merged_log(12345, 2)  # a second reader: a log of its own, from the start
        assert [line.text for _, line in first.lines] == ["rank 2 step 5", "epoch 1 done"]  # rank by rank
        assert hosted.merged_log(12345, 2).lines == []  # and its news only, after that
        server.close()  # the process that held the state has gone: this kernel drains its own, anew
        hosted.close()
        assert fed.drain(hosted, ()) and not hosted.hosted and len(rebuilt) == 1
        expected = MergedLog(3, limit=6)
        expected.drain(rebuilt[0])
        assert fed.shown() == expected.shown() and len(fed.lines) == 6
    finally:
        server.close()


def test_a_token_with_non_ascii_characters_is_refused_and_the_feed_goes_on(served, socket_path):
    _, server, stops = served

    def ask(record):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(socket_path)
            conn.sendall((events.dumps(record) + "\n").encode())
            return conn.recv(64)

    # before, compare_digest raised TypeError: the connection's thread ended with a traceback
    # and the request got no answer at all
    assert ask(events.StopRun(rank=-1, token="jeton-ü", by="x")) == b"refused\n" and stops == []
    refusal = b"not the run's token"
    answer = ask(events.ReadState(rank=-1, token="\u00fc" * 8, read="facts"))
    assert answer == ANSWER.pack(b"r", len(refusal), 0.0) + refusal
    assert ask(events.StopRun(rank=-1, token=TOKEN, by="a test")) == b"ok\n" and stops == ["a test"]


class SlowSnapshots:
    """A run's state whose snapshots wait for ``go`` (the process that holds it, busy), its
    other reads at once."""

    def __init__(self):
        self.state = fed_state()
        self.asked = threading.Event()
        self.go = threading.Event()

    def snapshot(self, since=None):
        self.asked.set()
        assert self.go.wait(60)
        return self.state.snapshot(since)

    def __getattr__(self, name):
        return getattr(self.state, name)


def test_a_slow_answer_holds_up_no_other_reader(socket_path, monkeypatch):
    from torchdist_magic.handles import feed

    monkeypatch.setattr(feed, "READ_TIMEOUT", 120.0)  # the slow answer comes when the test says
    state = SlowSnapshots()
    server = FeedServer(socket_path, TOKEN, state, lambda by: None)
    hosted = HostedState(socket_path, TOKEN, 3, never)
    try:
        assert hosted.elapsed() >= 0  # the kernel's feed is open, one connection kept
        got = {}
        slow = threading.Thread(target=lambda: got.update(snap=hosted.snapshot()), daemon=True)
        slow.start()
        assert state.asked.wait(30)  # the snapshot is being worked out, its reader waits
        other = threading.Thread(target=lambda: got.update(logs=hosted.logs(1)), daemon=True)
        other.start()
        other.join(60)  # before, it waited behind the snapshot's reader's lock for as long
        assert "logs" in got and "snap" not in got and slow.is_alive()
        assert got["logs"] == state.state.logs(1)
        state.go.set()
        slow.join(60)
        assert got["snap"].ranks == state.state.snapshot().ranks and hosted.hosted
    finally:
        state.go.set()
        hosted.close()
        server.close()


def test_a_feed_that_does_not_answer_is_asked_once_more_then_the_journal_is_replayed_outside_the_lock(
    tmp_path, monkeypatch
):
    from torchdist_magic.handles import feed

    monkeypatch.setattr(feed, "READ_TIMEOUT", 0.2)
    path = os.path.join(user_directory(str(tmp_path)), "stalled.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    accepted = []

    def stall():  # takes each request and never answers
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=stall, daemon=True).start()
    replaying, go = threading.Event(), threading.Event()

    def fallback():
        replaying.set()
        assert go.wait(60)
        return fed_state()

    hosted = HostedState(path, TOKEN, 3, fallback)
    got = {}
    reader = threading.Thread(target=lambda: got.update(snap=hosted.snapshot()), daemon=True)
    reader.start()
    try:
        assert replaying.wait(60)
        assert len(accepted) == 2  # the first answer given up, asked once more on a fresh connection
        closer = threading.Thread(target=hosted.close, daemon=True)  # takes the feed's lock
        closer.start()
        closer.join(60)  # before, the replay ran under that lock
        assert not closer.is_alive() and reader.is_alive()
    finally:
        go.set()
        reader.join(60)
        listener.close()
        for conn in accepted:
            conn.close()
        os.unlink(path)
    assert got["snap"].num_processes == 3 and not hosted.hosted
    assert len(accepted) == 2  # made once: later reads go to it
    assert hosted.logs(0) == fed_state().logs(0)
