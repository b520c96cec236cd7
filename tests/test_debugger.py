"""A rank's debugger in a real kernel: ``--pdb`` post-mortem and ``breakpoint()`` on a rank.

The kernel is started through jupyter_client, as a frontend starts it; cells run with
``allow_stdin`` (the notebook can answer) or without it (nbval, ``nbconvert --execute``), and
this test answers each ``input_request`` as a user would type at the ``(Pdb rank r)`` prompt.
"""

import os
import pathlib
import re
import time

import pytest

from helpers import alive, pids_of_run, wait_until

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
pytest.importorskip("torch")

pytestmark = pytest.mark.kernel  # run under ipykernel 6 and 7 (README's test command)

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: a guard against a hang of the test itself, never an assertion on time
CELL_LIMIT = 240.0


class Kernel:
    """A real kernel of this interpreter, importing this tree (and the tests' helpers)."""

    def __init__(self):
        from jupyter_client import KernelManager

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env)
        self.pid = self.km.provisioner.process.pid
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code):
        reply = self.kc.execute_interactive(code, timeout=120, output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply["content"]
        return reply

    def cell(self, code, answer=None, allow_stdin=True):
        """Execute ``code``; each input request's prompt goes to ``answer(prompt)``, which returns
        the line to type (``None``: type nothing, as a user who walked away).

        The kernel's output (iopub) and its prompts (stdin) come on separate sockets, so what was
        printed before a prompt may arrive after it.  ``answer.expected(prompt)``, where
        ``answer`` has it, names the text the cell prints before that prompt (after the line
        typed last): the prompt is not recorded or answered until that text came (or the
        cell's guard fails the test), so the text is in the order the user saw it.  What the
        cell showed: ``Cell`` with its prompts, its text (streams and results) and its error."""
        msg_id = self.kc.execute(code, allow_stdin=allow_stdin)
        out = Cell()
        deadline = time.monotonic() + CELL_LIMIT
        since = 0  # where in out.text the output after the line typed last begins
        while not out.idle:
            assert time.monotonic() < deadline, f"the cell did not finish; so far: {out.text}"
            self._read_output(msg_id, out)
            try:
                msg = self.kc.get_stdin_msg(timeout=0.02)
            except Exception:  # queue.Empty  # noqa: BLE001
                msg = None
            if msg is not None and msg["msg_type"] == "input_request":
                prompt = msg["content"]["prompt"]
                expected = getattr(answer, "expected", lambda prompt: None)(prompt)
                if expected:
                    self._wait_for_output(msg_id, out, expected, since, deadline)
                out.prompts.append(prompt)
                out.text += prompt
                line = answer(prompt) if answer is not None else None
                if line is not None:
                    out.text += line + "\n"
                    since = len(out.text)
                    self.kc.input(line)
        return out

    def _read_output(self, msg_id, out):
        """What the cell's iopub has now, into ``out`` (``out.idle`` once the cell finished)."""
        while not out.idle:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.02)
            except Exception:  # queue.Empty  # noqa: BLE001
                return
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.text += content["text"]
            elif kind in ("execute_result", "display_data"):
                out.text += content["data"].get("text/plain", "") + "\n"
            elif kind == "error":
                out.error = (content["ename"], content["evalue"])
                out.text += "\n".join(content["traceback"])
            elif kind == "status" and content["execution_state"] == "idle":
                out.idle = True

    def _wait_for_output(self, msg_id, out, output, start, deadline):
        """Read iopub until ``output`` shows after ``start`` in ``out.text`` (a prompt waits
        meanwhile, so the cell cannot finish first)."""
        while output not in out.text[start:]:
            assert time.monotonic() < deadline and not out.idle, f"no {output!r} after the line typed: {out.text}"
            self._read_output(msg_id, out)

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


class Cell:
    def __init__(self):
        self.prompts = []
        self.text = ""
        self.error = None
        self.idle = False


class Typist:
    """A user at the prompts: ``lines[rank]`` are typed in order at ``(Pdb rank r)``, each a
    line or ``(line, what it prints)``; ``opening[rank]``: what the session prints before its
    first prompt.  Both are what ``expected`` tells ``Kernel.cell`` to wait for."""

    def __init__(self, lines, opening=None):
        self.lines = {rank: list(seq) for rank, seq in lines.items()}
        self.opening = dict(opening or {})
        self.ranks = []
        self._printing = {}  # rank -> what its line typed last prints

    @staticmethod
    def rank_of(prompt):
        m = re.fullmatch(r"\(Pdb rank (\d+)\) ", prompt)
        assert m, f"not a rank's pdb prompt: {prompt!r}"
        return int(m.group(1))

    def expected(self, prompt):
        rank = self.rank_of(prompt)
        if rank not in self.ranks:
            return self.opening.get(rank)
        return self._printing.get(rank)

    def __call__(self, prompt):
        rank = self.rank_of(prompt)
        self.ranks.append(rank)
        line = self.lines[rank].pop(0)
        line, self._printing[rank] = line if isinstance(line, tuple) else (line, None)
        return line


@pytest.fixture(scope="module")
def kernel():
    kernel = Kernel()
    try:
        kernel.run("%load_ext torchdist_magic")
        yield kernel
    finally:
        kernel.close()
    wait_until(lambda: not alive(kernel.pid), 10, "the kernel to end")


def printed(kernel, code):
    """Everything ``code`` printed in the kernel (however many stream messages it came in)."""
    texts = []

    def keep(msg):
        if msg["msg_type"] == "stream":
            texts.append(msg["content"]["text"])

    reply = kernel.kc.execute_interactive(code, timeout=60, output_hook=keep)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(texts)


def last_run_id(kernel):
    return printed(kernel, "print(_torchdist_run.run_id)").strip()


def assert_no_worker_left(kernel):
    run_id = last_run_id(kernel)
    wait_until(lambda: not pids_of_run(run_id), 15, "every rank of the run to end")


FAILING_CELL = """\
x = 10 * (rank + 1)
def inner(y):
    z = y + 1
    raise ValueError(f"bad value {z}")
if rank == 1:
    inner(x)
x
"""


def recording_pids(cell: str, directory) -> str:
    """``cell`` with a first line that leaves each rank's pid in ``directory``/rank-<r>."""
    return f"import os; open(os.path.join({str(directory)!r}, f'rank-{{rank}}'), 'w').write(str(os.getpid()))\n" + cell


def others_gone_first(typist, directory, others):
    """``typist``, which at the first prompt first waits for the ranks ``others`` to be gone
    (their pids from ``recording_pids``): the run stopped them while the failing rank is held."""

    def answer(prompt):
        if not typist.ranks:
            for rank in others:
                pid = int((directory / f"rank-{rank}").read_text())
                wait_until(lambda: not alive(pid), 60, f"rank {rank} (pid {pid}) to be stopped while rank 1 is held")  # noqa: B023
        return typist(prompt)

    answer.expected = typist.expected
    return answer


def test_post_mortem_on_the_failing_rank_then_the_cell_raises(kernel, tmp_path):
    typist = Typist(
        {
            1: [
                ("p z", "21\n"),
                ("where", "-> raise ValueError"),
                ("up", "-> inner(x)"),
                ("p x", "20\n"),
                ("p y", "*** NameError: name 'y' is not defined"),
                ("p [rank, world_size]", "[1, 2]"),
                "q",
            ]
        },
        opening={1: "-> raise ValueError"},
    )
    cell = kernel.cell(
        "%%torchdist --np 2 --pdb --quiet\n" + recording_pids(FAILING_CELL, tmp_path),
        others_gone_first(typist, tmp_path, [0]),
    )
    assert typist.ranks == [1] * 7 and not typist.lines[1]
    text = cell.text
    assert "torchdist: rank 1 raised ValueError: bad value 21" in text
    assert "(Pdb rank 1) p z\n21\n(Pdb rank 1) where\n" in text  # p z, in inner()
    assert "inner(x)" in text and "-> raise ValueError" in text  # where
    assert "(Pdb rank 1) p x\n20\n(Pdb rank 1) p y\n" in text  # p x, a frame up: the cell
    assert "(Pdb rank 1) p y\n*** NameError: name 'y' is not defined\n" in text
    assert "(Pdb rank 1) p [rank, world_size]\n[1, 2]\n(Pdb rank 1) q\n" in text
    assert cell.error[0] == "RankFailure" and "bad value 21" in cell.error[1]
    assert "rank 1" in cell.error[1]  # the held rank stays the root cause
    logs = kernel.kc.execute_interactive(
        "assert '(Pdb' not in _torchdist_run.logs(1), _torchdist_run.logs(1)\n"
        "assert \"[torchdist] rank 0 was stopped: rank 1's failure is held for the debugger (--pdb)\" "
        "in _torchdist_run.logs(0), _torchdist_run.logs(0)\n"
        "assert _torchdist_run.state.ranks[0].state == 'cancelled', _torchdist_run.state.ranks[0].state\n"
        "assert [f.rank for f in _torchdist_run.state.failures()] == [1]",
        timeout=60,
        output_hook=lambda m: None,
    )
    assert logs["content"]["status"] == "ok", logs["content"]  # pdb's output went to the cell only
    assert_no_worker_left(kernel)


def test_config_pdb_and_an_interrupt_at_the_prompt_ends_the_session(kernel):
    kernel.run("%config TorchdistMagics.pdb = True")
    interrupted = []

    def answer(prompt):
        if not interrupted:
            interrupted.append(prompt)
            kernel.km.interrupt_kernel()
            return None
        raise AssertionError(f"a prompt after the interrupt: {prompt!r}")

    try:
        cell = kernel.cell("%%torchdist --np 2 --quiet\n" + FAILING_CELL, answer)
    finally:
        kernel.run("%config TorchdistMagics.pdb = False")
    assert interrupted == ["(Pdb rank 1) "]
    assert cell.error[0] == "RankFailure" and "bad value 21" in cell.error[1]
    assert_no_worker_left(kernel)


def test_breakpoint_p_then_c_returns_the_cells_value(kernel):
    typist = Typist({1: [("p x", "101\n"), ("n", "-> "), ("p seen", "102\n"), "c"]}, opening={1: "-> seen = x + 1"})
    cell = kernel.cell(
        "%%torchdist --np 2 --quiet\nx = 100 + rank\nif rank == 1:\n    breakpoint()\n    seen = x + 1\nx * 2\n", typist
    )
    assert cell.error is None, cell.text
    assert typist.ranks == [1, 1, 1, 1]
    assert "torchdist: rank 1 stopped at breakpoint(): c continues it, q stops the run" in cell.text
    assert "(Pdb rank 1) p x\n101\n" in cell.text and "(Pdb rank 1) p seen\n102\n" in cell.text
    assert cell.text.rstrip().endswith("200")  # rank 0's value
    assert_no_worker_left(kernel)


def test_a_breakpoint_hook_a_rank_only_inherited_from_ray_is_not_called(kernel):
    # ray.init() in a notebook sets Ray's driver hook in the kernel's environment, which the ranks
    # inherit: called there, it fails (a rank is no Ray driver), so the rank's own debugger opens
    typist = Typist({1: [("p x", "101\n"), "c"]}, opening={1: "-> breakpoint()"})
    cell = kernel.cell(
        "%%torchdist --np 2 --quiet --env PYTHONBREAKPOINT=ray.util.rpdb._driver_set_trace\n"
        "x = 100 + rank\nif rank == 1:\n    breakpoint()\nx * 2\n",
        typist,
    )
    assert cell.error is None, cell.text
    assert typist.ranks == [1, 1]
    assert "torchdist: rank 1 stopped at breakpoint(): c continues it, q stops the run" in cell.text
    assert "(Pdb rank 1) p x\n101\n" in cell.text
    assert cell.text.rstrip().endswith("200")
    assert_no_worker_left(kernel)


def test_q_at_a_breakpoint_stops_the_run(kernel):
    typist = Typist({0: ["q"]})
    cell = kernel.cell("%%torchdist --np 2 --quiet\nif rank == 0:\n    breakpoint()\nrank\n", typist)
    assert typist.ranks == [0]
    assert cell.error[0] == "RankFailure"
    assert "the debugger on rank 0 was quit, which stops the run" in cell.error[1]
    assert_no_worker_left(kernel)


def test_two_ranks_at_breakpoints_one_session_at_a_time(kernel):
    typist = Typist(
        {0: [("p who", "'rank-0-here'"), "c"], 1: [("p who", "'rank-1-here'"), "c"]},
        opening={0: "> <torchdist cell", 1: "> <torchdist cell"},
    )
    cell = kernel.cell("%%torchdist --np 2 --all-ranks --quiet\nwho = f'rank-{rank}-here'\nbreakpoint()\nwho\n", typist)
    assert cell.error is None, cell.text
    first = typist.ranks[0]
    assert typist.ranks == [first, first, 1 - first, 1 - first]  # one session, then the other
    assert "'rank-0-here'" in cell.text and "'rank-1-here'" in cell.text
    assert f"(rank {1 - first} waits for their turn)" in cell.text
    assert "['rank-0-here', 'rank-1-here']" in cell.text
    assert_no_worker_left(kernel)


def test_without_stdin_breakpoint_is_skipped_with_one_line_and_pdb_says_so(kernel):
    kernel.run("%config TorchdistMagics.view = 'text'")
    try:
        cell = kernel.cell("%%torchdist --np 2\nx = 5 + rank\nif rank == 1:\n    breakpoint()\nx\n", allow_stdin=False)
        assert cell.error is None and not cell.prompts, cell.text
        assert cell.text.count("breakpoint() skipped") == 1, cell.text
        assert "torchdist: breakpoint() skipped on rank 1: the notebook has no input to debug with" in cell.text
        assert cell.text.rstrip().endswith("5")
        assert_no_worker_left(kernel)
        cell = kernel.cell("%%torchdist --np 2 --pdb\n" + FAILING_CELL, allow_stdin=False)
        assert not cell.prompts and cell.error[0] == "RankFailure", cell.text
        assert "torchdist: --pdb: this notebook cannot read input here" in cell.text
        assert_no_worker_left(kernel)
    finally:
        kernel.run("%config TorchdistMagics.view = 'auto'")


def test_a_session_without_input_ends_at_the_idle_limit(kernel):
    cell = kernel.cell("%%torchdist --np 2 --pdb --debug-idle-timeout 1 --quiet\n" + FAILING_CELL, lambda prompt: None)
    assert cell.prompts == ["(Pdb rank 1) "]
    assert "torchdist: no input for 1 s: the debugger session on rank 1 ends (--debug-idle-timeout)" in cell.text
    assert cell.error[0] == "RankFailure" and "bad value 21" in cell.error[1]
    assert_no_worker_left(kernel)


def post_mortem_on_spark(kernel, directory, backend):
    """The failing cell under ``--pdb`` on the kernel's ``spark`` session: rank 1 is held and
    debugged while rank 0's task stopped its rank and ended (the stage goes on), then the cell
    raises rank 1's failure and nothing of the run is left."""
    typist = Typist(
        {1: [("p z", "21\n"), ("up", "-> inner(x)"), ("p x", "20\n"), "q"]}, opening={1: "-> raise ValueError"}
    )
    cell = kernel.cell(
        "%%torchdist --np 2 --pdb --quiet\n" + recording_pids(FAILING_CELL, directory),
        others_gone_first(typist, directory, [0]),
    )
    assert typist.ranks == [1, 1, 1, 1], cell.text
    assert "(Pdb rank 1) p z\n21\n" in cell.text and "(Pdb rank 1) p x\n20\n" in cell.text
    assert cell.error[0] == "RankFailure" and "bad value 21" in cell.error[1] and "rank 1" in cell.error[1]
    shown = printed(
        kernel,
        "print(type(_torchdist_run.backend).__name__, [f.rank for f in "
        "_torchdist_run.state.failures()], _torchdist_run.state.ranks[0].state)",
    ).strip()
    assert shown == f"{backend} [1] cancelled"  # the ranks ran in Spark tasks; rank 0 was stopped
    assert_no_worker_left(kernel)


@pytest.mark.spark
def test_post_mortem_on_a_spark_local2_rank(kernel, tmp_path):
    pytest.importorskip("pyspark")
    kernel.run(
        f"from spark_fixtures import SparkSessions\n_sessions = SparkSessions({str(tmp_path)!r})\n"
        "spark = _sessions.get('local[2]')"
    )
    try:
        post_mortem_on_spark(kernel, tmp_path, "SparkBarrierBackend")
    finally:
        kernel.run("_sessions.stop()")


@pytest.mark.spark
def test_post_mortem_on_a_spark_connect_rank(kernel, connect_server, tmp_path):
    kernel.run(
        f"from pyspark.sql import SparkSession\nspark = SparkSession.builder.remote({connect_server.url!r})"
        ".getOrCreate()"
    )
    try:
        post_mortem_on_spark(kernel, tmp_path, "SparkConnectBackend")
    finally:
        kernel.run("spark.stop()\ndel spark")


class Unreachable:
    """A classic Spark backend whose tasks get an address where no driver listens."""

    def __new__(cls, session):
        import dataclasses

        from torchdist_magic.backends.spark_classic import SparkBarrierBackend

        class _Unreachable(SparkBarrierBackend):
            def start(self, ctx):
                ctx.spec = dataclasses.replace(ctx.spec, channel_address="127.0.0.1:9")
                return super().start(ctx)

        return _Unreachable(session)


def fail_on_rank_1():
    from torchdist_magic import rank

    if rank() == 1:
        raise ValueError("bad shard on rank 1")


@pytest.mark.spark
def test_pdb_says_so_when_the_executors_cannot_reach_the_notebook(spark_local2, monkeypatch):
    from helpers import assert_nothing_left
    from torchdist_magic import LaunchOptions, RankFailure
    import torchdist_magic.driver.distributor as distributor
    from torchdist_magic.handles.follow import follow

    monkeypatch.setattr(distributor, "make_backend", lambda options: Unreachable(spark_local2))
    run = distributor.submit(
        fail_on_rank_1, (), {}, LaunchOptions(num_processes=2, backend="spark", pdb=True), debug_input=True
    )
    with pytest.raises(RankFailure) as info:
        follow(run)
    assert (info.value.rank, info.value.message) == (1, "bad shard on rank 1")
    assert "torchdist: --pdb: rank 1" in run.logs(1)
    assert "cannot reach the notebook's event channel, so its failure is not held for a debugger" in run.logs(1)
    assert_nothing_left(run)
