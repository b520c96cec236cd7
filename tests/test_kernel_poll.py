"""Widget messages while a cell blocks the kernel (view/kernel_poll.py): the Stop button and the
log selector answer during a cell that waits for a run, and every other request sent meanwhile
runs after the cell, in the order it was sent.

The kernel tests start a real kernel of this interpreter through jupyter_client and act as the
frontend does (a click is a ``comm_msg`` on the shell channel).  CI runs this file under
ipykernel 6 and ipykernel 7: the poller leans on how each one reads its shell channel.
"""

import re
import threading
import time
import types

import pytest

from helpers import alive, pids_of_run, wait_until
from torchdist_magic.view.kernel_poll import KernelPoll

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

#: what %%torchdist does, without a real run: a run that lasts until Stop (or ``ends_after``
#: seconds), waited for in the kernel's main thread with a widget view updated every 0.1 s
SETUP = '''
import threading, time
from torchdist_magic.core import events
from torchdist_magic.driver.handle import StateAnswers
from torchdist_magic.driver.state import RunState
from torchdist_magic.view import make_view

class WaitingRun(StateAnswers):
    can_profile = False

    def __init__(self, num_processes, ends_after=None):
        self.run_id = f"poll-{time.time_ns()}"
        self.state = RunState(self.run_id, num_processes, backend="test")
        for r in range(num_processes):
            self.state.apply(events.Started(rank=r, host="node", pid=r + 1))
            self.state.apply(events.Log(rank=r, line=f"hello from rank {r}"))
        self._ended = threading.Event()
        if ends_after is not None:
            threading.Timer(ends_after, self._end, ("succeeded",)).start()

    def _end(self, state):
        self.state.finish(state, message="stopped from the view" if state == "cancelled" else "")
        self._ended.set()

    def cancel(self, by="cancel()"):
        self._end("cancelled")

    def wait(self, timeout=None):
        return self._ended.wait(timeout)

    def done(self):
        return self._ended.is_set()

def wait_for(run, seconds):
    view = make_view(run, "widget", log_hint="run.logs(rank)")
    deadline = time.monotonic() + seconds
    try:
        while not run.wait(0.1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not stopped within {seconds} s")
            view.update()
    finally:
        view.close()
    if run.state.state == "cancelled":
        raise RuntimeError("cancelled by the Stop button")
    return run.state.state
'''


class Kernel:
    """A real kernel of this interpreter (jupyter_client's ``python3`` is ``sys.executable``)."""

    def __init__(self):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel()
        self.pid = self.km.provisioner.process.pid
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def iopub(self, timeout=60):
        return self.kc.get_iopub_msg(timeout=timeout)

    def run(self, code):
        reply = self.kc.execute_interactive(code, timeout=60, output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply["content"]
        return reply

    def settle(self, tries=20):
        """Run an empty cell until one runs: after a cell that failed, ipykernel 6 aborts every
        execute request it takes until its own "stop aborting" event comes off its queue
        (``Kernel._abort_queues``, ``stop_on_error_timeout``), and a request sent right after the
        failing cell's replies can come before it.  The next test's cell would be aborted."""
        statuses = []
        for _ in range(tries):
            reply = self.kc.execute_interactive("pass", timeout=60, output_hook=lambda msg: None)
            statuses.append(reply["content"]["status"])
            if statuses[-1] == "ok":
                return
        raise AssertionError(f"the kernel ran no cell in {tries} tries: {statuses}")

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


pytestmark = pytest.mark.kernel  # run under ipykernel 6 and 7 (README's test command)


@pytest.fixture(scope="module")
def kernel():
    import ipykernel

    kernel = Kernel()
    try:
        # the kernel under test is this interpreter's ipykernel (6 or 7, whichever CI installed)
        kernel.run(f"import ipykernel\nassert ipykernel.__version__ == {ipykernel.__version__!r}")
        kernel.run(SETUP)
        yield kernel
    finally:
        kernel.close()
    wait_until(lambda: not alive(kernel.pid), 10, "the kernel to end")


@pytest.fixture(autouse=True)
def _settled(request):
    """Each test of the module's kernel starts with a kernel that runs cells (``Kernel.settle``)."""
    if "kernel" in request.fixturenames:
        request.getfixturevalue("kernel").settle()


def widget_state(msg):
    return msg["content"].get("data", {}).get("state", {})


def comm_with_class(msg, css_class):
    """The comm id of the widget that ``msg`` gives ``css_class`` (ipywidgets sends the classes
    in an update after opening the comm), else None."""
    if msg["msg_type"] in ("comm_open", "comm_msg") and css_class in widget_state(msg).get("_dom_classes", ()):
        return msg["content"]["comm_id"]
    return None


def send_comm(kc, comm_id, data):
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))


def replies(kc, count, timeout=60):
    return [kc.get_shell_msg(timeout=timeout) for _ in range(count)]


def test_stop_and_the_log_selector_answer_while_a_cell_blocks(kernel):
    kc = kernel.kc
    blocking = kc.execute("wait_for(WaitingRun(2), 120)")
    queued = kc.execute("print('queued cell ran')")  # waits behind the blocking cell
    stop, select, logs_widget, sent = None, None, None, False
    seen = []  # (msg_type, what) in iopub order, for the blocking cell's messages
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        msg = kernel.iopub()
        stop = stop or comm_with_class(msg, "torchdist-stop")
        select = select or comm_with_class(msg, "torchdist-log-select")
        logs_widget = logs_widget or comm_with_class(msg, "torchdist-logs-view")
        if not sent and stop and select and logs_widget:
            # the frontend: pick rank 1's log, then click Stop
            send_comm(kc, select, {"method": "update", "state": {"index": 1}, "buffer_paths": []})
            send_comm(kc, stop, {"method": "custom", "content": {"event": "click"}})
            sent = True
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == logs_widget:
            value = str(widget_state(msg).get("value", ""))
            if "hello from rank 1" in value:
                seen.append(("comm_msg", "rank 1 log shown"))
        if msg["parent_header"].get("msg_id") == blocking:
            seen.append((msg["msg_type"], msg["content"]))
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    assert sent, "the view's widgets never opened"
    kinds = [kind for kind, _ in seen]
    assert ("comm_msg", "rank 1 log shown") in seen, "the log selector did not show rank 1's log"
    # during the cell, not after it
    assert seen.index(("comm_msg", "rank 1 log shown")) < kinds.index("error")
    (error,) = [content for kind, content in seen if kind == "error"]
    assert (error["ename"], error["evalue"]) == ("RuntimeError", "cancelled by the Stop button")
    # what the notebook keeps: the summary, every rank's last lines in it
    summary = [content["data"] for kind, content in seen if kind == "update_display_data"][-1]
    assert 'data-state="cancelled"' in summary["text/html"]
    assert summary["text/html"].count('class="torchdist-rank-log"') == 2
    assert '<details class="torchdist-rank-log" data-rank="1" data-state="cancelled" open' in summary["text/html"]
    assert "full log: run.logs(1)" in summary["text/html"]
    assert summary["text/plain"].startswith("torchdist: cancelled")
    assert "  [rank 0] hello from rank 0\n  [rank 1] hello from rank 1" in summary["text/plain"]
    # the request queued behind the failing cell is answered in order, aborted as Jupyter
    # aborts what was queued behind a failing cell
    got = replies(kc, 2)
    assert [r["parent_header"]["msg_id"] for r in got] == [blocking, queued]
    assert [r["content"]["status"] for r in got] == ["error", "aborted"]


def test_requests_sent_during_a_blocking_cell_run_after_it_in_order(kernel):
    kc = kernel.kc
    # the cell ends only when Stop is clicked, after the requests: they all came while it ran
    blocking = kc.execute(
        "try:\n    ended = wait_for(WaitingRun(2), 60)\nexcept RuntimeError as exc:\n    ended = str(exc)"
    )
    stop, deadline = None, time.monotonic() + 60
    while stop is None and time.monotonic() < deadline:  # the view is up: its poller takes what comes now
        msg = kernel.iopub()
        if msg["parent_header"].get("msg_id") == blocking:
            stop = comm_with_class(msg, "torchdist-stop")
    assert stop, "the view's Stop button never opened"
    first = kc.execute("order = ['first']")
    info = kc.kernel_info()
    complete = kc.complete("ord", 3)
    second = kc.execute("order.append('second'); print(order, ended)")
    send_comm(kc, stop, {"method": "custom", "content": {"event": "click"}})  # behind them on the shell channel
    got = replies(kc, 5)
    assert [r["parent_header"]["msg_id"] for r in got] == [blocking, first, info, complete, second]
    assert [r["msg_type"] for r in got] == [
        "execute_reply",
        "execute_reply",
        "kernel_info_reply",
        "complete_reply",
        "execute_reply",
    ]
    assert all(r["content"]["status"] == "ok" for r in got)
    counts = [got[i]["content"]["execution_count"] for i in (0, 1, 4)]
    assert counts == [counts[0], counts[0] + 1, counts[0] + 2]
    assert "order" in got[3]["content"]["matches"]
    while True:  # the second cell's output went to the second cell
        msg = kernel.iopub()
        if msg["parent_header"].get("msg_id") == second and msg["msg_type"] == "stream":
            assert msg["content"]["text"] == "['first', 'second'] cancelled by the Stop button\n"
            break
    # the shell stream is the kernel's again: a plain cell runs as usual
    assert kernel.run("6 * 7")["content"]["status"] == "ok"


def test_stop_ends_a_real_run_of_a_blocking_torchdist_cell(kernel):
    pytest.importorskip("torch")
    kc = kernel.kc
    kernel.run("%load_ext torchdist_magic")
    long_cell = kc.execute(
        "%%torchdist --np 2\nimport time\nfor i in progress(range(30000), desc='step'):\n    time.sleep(0.02)\n"
    )
    stop, clicked, outputs, run_ids = None, False, [], set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        msg = kernel.iopub()
        stop = stop or comm_with_class(msg, "torchdist-stop")
        value = str(widget_state(msg).get("value", ""))
        run_ids.update(re.findall(r'data-run-id="([^"]+)"', value))
        if not clicked and stop and 'class="torchdist-rank-row" data-rank="1" data-state="running"' in value:
            send_comm(kc, stop, {"method": "custom", "content": {"event": "click"}})
            clicked = True
        if msg["parent_header"].get("msg_id") == long_cell:
            outputs.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    assert clicked, "the run view never showed a running rank"
    assert [m["content"]["ename"] for m in outputs if m["msg_type"] == "error"] == ["RunCancelled"]
    summary = [m["content"]["data"] for m in outputs if m["msg_type"] == "update_display_data"][-1]
    assert 'data-state="cancelled"' in summary["text/html"]
    assert "_torchdist_run.logs(1)" in summary["text/html"]
    assert summary["text/plain"].startswith("torchdist: cancelled")
    (reply,) = replies(kc, 1)
    assert reply["parent_header"]["msg_id"] == long_cell and reply["content"]["status"] == "error"
    assert len(run_ids) == 1
    wait_until(lambda: not pids_of_run(next(iter(run_ids))), 10, "the stopped run's processes to end")


# -- the poller without a kernel process -----------------------------------------------------------
class Events:
    """IPython's ``shell.events`` as far as the poller uses it."""

    def __init__(self):
        self.callbacks = []

    def register(self, name, fn):
        self.callbacks.append((name, fn))

    def unregister(self, name, fn):
        self.callbacks.remove((name, fn))

    def trigger(self, name):
        for event, fn in list(self.callbacks):
            if event == name:
                fn()


@pytest.fixture
def shell_channel(monkeypatch):
    """A kernel-like shell whose main shell stream is the receiving end of a zmq pair, with the
    comm manager and the kernel's own handler recorded; ``send(msg_type)`` sends a message."""
    import comm
    import zmq
    from jupyter_client.session import Session
    from tornado.ioloop import IOLoop
    from zmq.eventloop.zmqstream import ZMQStream

    context = zmq.Context()
    receiver, sender = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    receiver.bind("inproc://shell")
    sender.connect("inproc://shell")
    loop = IOLoop(make_current=False)
    stream = ZMQStream(receiver, io_loop=loop)
    session = Session(key=b"secret")
    delivered, handled = [], []

    def kernel_handler(frames):
        delivered.append(
            session.deserialize(session.feed_identities(frames, copy=False)[1], copy=False)["header"]["msg_type"]
        )

    stream.on_recv(kernel_handler, copy=False)
    manager = types.SimpleNamespace(
        **{kind: lambda s, i, m: handled.append(m["content"]["n"]) for kind in ("comm_open", "comm_msg", "comm_close")}
    )
    monkeypatch.setattr(comm, "get_comm_manager", lambda: manager)
    shell = types.SimpleNamespace(kernel=types.SimpleNamespace(session=session, shell_stream=stream), events=Events())
    monkeypatch.setattr("torchdist_magic.view.kernel_poll.main_shell_stream", lambda kernel: kernel.shell_stream)

    def send(msg_type, n=0):
        session.send(sender, msg_type, {"n": n}, ident=[b"frontend"])

    yield types.SimpleNamespace(
        shell=shell, stream=stream, send=send, delivered=delivered, handled=handled, kernel_handler=kernel_handler
    )
    stream.close()
    sender.close()
    loop.close()
    context.term()


def poll_until(poller, ready, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not ready() and time.monotonic() < deadline:
        poller.poll()
        time.sleep(0.01)


def test_widget_messages_are_handled_and_the_rest_passed_on_in_order(shell_channel):
    ch = shell_channel
    poller = KernelPoll.start(ch.shell)
    assert poller is not None and KernelPoll.start(ch.shell) is None  # one at a time
    for msg_type, n in [
        ("comm_msg", 1),
        ("execute_request", 0),
        ("comm_open", 2),
        ("kernel_info_request", 0),
        ("comm_close", 3),
        ("execute_request", 0),
    ]:
        ch.send(msg_type, n)
    poll_until(poller, lambda: len(ch.delivered) == 3 and len(ch.handled) == 3)
    assert ch.handled == [1, 2, 3]
    assert ch.delivered == ["execute_request", "kernel_info_request", "execute_request"]
    poller.close()
    assert ch.stream._recv_callback is ch.kernel_handler  # the kernel's handler is back
    assert ch.shell.events.callbacks == [] and KernelPoll._active is None
    ch.send("comm_msg", 4)
    assert poller.poll() == 0  # closed: nothing taken


def test_the_end_of_the_cell_gives_the_stream_back(shell_channel):
    ch = shell_channel
    poller = KernelPoll.start(ch.shell)
    ch.shell.events.trigger("post_execute")  # comm handlers trigger it: not the end of the cell
    assert KernelPoll._active is poller
    ch.shell.events.trigger("post_run_cell")
    assert KernelPoll._active is None and ch.stream._recv_callback is ch.kernel_handler
    poller.close()  # closing again does nothing


def test_no_poller_without_a_kernel_or_off_the_main_thread(shell_channel):
    assert KernelPoll.start(None) is None
    assert KernelPoll.start(types.SimpleNamespace(kernel=None)) is None
    found = []
    thread = threading.Thread(target=lambda: found.append(KernelPoll.start(shell_channel.shell)))
    thread.start()
    thread.join()
    assert found == [None]  # the panel refreshes its view from a thread: no polling there
    assert KernelPoll._active is None


def test_interrupting_the_kernel_stops_every_rank_of_a_torchdist_cell(tmp_path):
    import glob
    import os

    from helpers import wait_until

    kernel = Kernel()  # a kernel of its own: the interrupt must not reach another test's cell
    try:
        kc = kernel.kc
        kernel.run("%load_ext torchdist_magic")
        marks = str(tmp_path)
        long_cell = kc.execute(
            "%%torchdist --np 2\nimport os, time\n"
            f"open(os.path.join({marks!r}, f'rank{{rank}}-pid{{os.getpid()}}'), 'w').close()\n"
            "time.sleep(600)\n"
        )

        def ranks_started():
            if kc.shell_channel.msg_ready():  # the cell ended first: say how, not "timed out"
                reply = kc.get_shell_msg(timeout=1)
                raise AssertionError(f"the cell ended before both ranks started: {reply['content']}")
            found = sorted(glob.glob(os.path.join(marks, "rank*-pid*")))
            return found if len(found) == 2 else None

        started = wait_until(ranks_started, 120, "both ranks to start")
        pids = [int(path.rsplit("-pid", 1)[1]) for path in started]
        kernel.km.interrupt_kernel()  # the frontend's ■
        outputs = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            msg = kernel.iopub()
            if msg["parent_header"].get("msg_id") == long_cell:
                outputs.append(msg)
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
        assert [m["content"]["ename"] for m in outputs if m["msg_type"] == "error"] == ["KeyboardInterrupt"]
        (reply,) = replies(kc, 1)
        assert reply["parent_header"]["msg_id"] == long_cell and reply["content"]["status"] == "error"
        # the kernel stays usable, and the cell's run was cancelled
        check = kc.execute(
            "", user_expressions={"run_id": "_torchdist_run.run_id", "state": "_torchdist_run.state.state"}
        )
        (reply,) = replies(kc, 1)
        assert reply["parent_header"]["msg_id"] == check and reply["content"]["status"] == "ok"
        found = {k: v["data"]["text/plain"].strip("'") for k, v in reply["content"]["user_expressions"].items()}
        assert found["state"] == "cancelled"
        wait_until(
            lambda: not pids_of_run(found["run_id"]) and not any(alive(p) for p in pids),
            10,
            "every process of the interrupted run to end",
        )
    finally:
        kernel.close()
    wait_until(lambda: not alive(kernel.pid), 10, "the test's kernel to exit")
