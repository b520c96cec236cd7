"""A run outlives its kernel (``--detach``): real kernels (jupyter_client) start a detached run
and are killed with SIGKILL; a new kernel lists it, attaches, gets rank 0's value and every line
printed in between; ``stop`` from another kernel; a run not detached still ends with its kernel."""

import json
import os
import signal

import pytest

from torchdist_magic.driver import history

from helpers import alive, pids_of_run, touch, wait_until

pytest.importorskip("ipykernel")
pytestmark = pytest.mark.kernel  # run under ipykernel 6 and 7 (README's test command)


class Kernel:
    """A real kernel of this interpreter, with this test's history (``TORCHDIST_HOME``)."""

    def __init__(self, home):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env={**os.environ, history.HOME_ENV: str(home)})
        self.pid = self.km.provisioner.process.pid
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.run("%load_ext torchdist_magic\n%config TorchdistMagics.view = 'text'")

    def run(self, code, timeout=120):
        """Run ``code``; its stdout (the cell must succeed)."""
        out = []

        def keep(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=keep)
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)

    def value(self, expression):
        """``expression``'s value in the kernel, through JSON."""
        return json.loads(eval(self.run(f"import json as _j\nprint(repr(_j.dumps({expression})))")))

    def kill(self):
        """SIGKILL, as an out-of-memory killer or a crash ends a kernel."""
        self.kc.stop_channels()
        os.kill(self.pid, signal.SIGKILL)
        wait_until(lambda: not alive(self.pid), 30, "the kernel to die")
        self.km.cleanup_resources()

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernels(home):
    """``start()`` -> a new kernel; this test and its kernels share a history of their own."""
    started = []

    def start():
        started.append(Kernel(home))
        return started[-1]

    yield start
    for kernel in started:
        if alive(kernel.pid):
            kernel.close()


DETACHED_CELL = '''%%torchdist --np 2 --local --detach
import os, time
print(f"before {rank}", flush=True)
while not os.path.exists(GO):
    time.sleep(0.05)
for i in range(3):
    print(f"while away {rank}.{i}", flush=True)
while not os.path.exists(FINISH):
    time.sleep(0.05)
{"rank": rank, "answer": 42}
'''


def test_a_detached_run_outlives_a_killed_kernel_and_a_new_kernel_attaches(kernels, tmp_path):
    go, finish = str(tmp_path / "go"), str(tmp_path / "finish")
    first = kernels()
    first.run(f"GO, FINISH = {go!r}, {finish!r}")
    out = first.run(DETACHED_CELL)
    run_id = first.value("_torchdist_run.run_id")
    assert f"torchdist: detached run {run_id} started (np=2)" in out
    wait_until(lambda: len(pids_of_run(run_id)) >= 2, 60, "both ranks to start")
    first.kill()
    touch(go)  # the ranks print while no kernel is attached

    second = kernels()
    listed = second.value("[(r.run_id, r.state, r.detached) for r in __import__('torchdist_magic').runs()]")
    assert [run_id, "running", True] in listed
    out = second.run("%torchdist runs")
    assert run_id in out and "running" in out
    assert history.read_record(run_id).state == "running"
    touch(finish)
    second.run(f"value = %torchdist attach {run_id}")
    assert second.value("value") == {"rank": 0, "answer": 42}
    log = second.value("_torchdist_run.logs(1)")
    assert log == "before 1\nwhile away 1.0\nwhile away 1.1\nwhile away 1.2\n"
    wait_until(lambda: not pids_of_run(run_id), 30, "the run's ranks to end")


def test_stop_from_another_kernel(kernels, tmp_path):
    first = kernels()
    first.run(f"GO, FINISH = {str(tmp_path / 'never')!r}, {str(tmp_path / 'never')!r}")
    first.run(DETACHED_CELL)
    run_id = first.value("_torchdist_run.run_id")
    wait_until(lambda: len(pids_of_run(run_id)) >= 2, 60, "both ranks to start")
    supervisor = first.value("_torchdist_run.record.pid")
    other = kernels()
    assert other.run(f"%torchdist stop {run_id}") == f"torchdist: run {run_id} is stopping\n"
    wait_until(lambda: not pids_of_run(run_id) and not alive(supervisor), 60, "the run to end")
    assert history.read_record(run_id).state == "cancelled"
    assert first.value(f"__import__('torchdist_magic').attach({run_id!r}).wait(30)") is True


def test_a_run_not_detached_still_ends_with_its_kernel(kernels, tmp_path):
    kernel = kernels()
    kernel.run(
        "from torchdist_magic import Distributor\nimport time\n"
        "def sleeps():\n    print('sleeping', flush=True)\n    time.sleep(600)\n"
        "run = Distributor(num_processes=2, show=None).submit(sleeps)"
    )
    run_id = kernel.value("run.run_id")
    wait_until(lambda: len(pids_of_run(run_id)) >= 2, 60, "both ranks to start")
    kernel.kill()
    wait_until(lambda: not pids_of_run(run_id), 30, "the ranks to end with their kernel")
    record = history.read_record(run_id)
    assert record.state == "failed" and not record.detached
    assert record.failure == f"the kernel (or process) that ran it (pid {kernel.pid}) ended before the run did"
