"""Long runs: every attempt's root cause when restarts run out, graceful stops, where ranks were
at a timeout, progress from tqdm, rich, Lightning and Hugging Face's Trainer, bounded driver
memory for logs, and the checkpoint helpers.  Local processes (the backend contract in
``test_contract`` covers restarts, hangs and stops on Spark too)."""

import gc
import importlib.util
import inspect
import os
import sys
import time

import pytest

from helpers import assert_no_survivors, touch, wait_until
from torchdist_magic import RankFailure, rank, restart_count
from torchdist_magic.rank.runtime import load_checkpoint, save_checkpoint


def needs(*modules):
    """Skip unless ``modules`` are installed (found, not imported: the ranks import them)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def _forget_runs():
    """Drop the module's reference to the latest run, so that only the test holds its runs."""
    import torchdist_magic.driver.distributor as distributor

    distributor._last_run = None


# -- restarts --------------------------------------------------------------------------------------
def fail_on_rank1():
    if rank() == 1:
        raise ValueError(f"bad data in attempt {restart_count() + 1}")
    time.sleep(600)


def test_when_restarts_run_out_the_error_has_every_attempts_root_cause(local_distributor):
    from torchdist_magic.view.model import run_facts
    from torchdist_magic.view.text import summary

    # the same ValueError at the same line each time: only "always" restarts it past the repeat
    run = local_distributor(2, max_restarts=2, restart_on="always").submit(fail_on_rank1)
    with pytest.raises(RankFailure) as info:
        run.result(timeout=120)
    err = info.value
    assert (err.rank, err.exc_type, err.message) == (1, "ValueError", "bad data in attempt 3")
    assert [f.message for f in err.attempts] == [f"bad data in attempt {n}" for n in (1, 2, 3)]
    text = str(err)
    assert "Every attempt failed (3 in all; each failure restarted the job):" in text
    assert "  attempt 1: rank 1 on " in text and "raised ValueError: bad data in attempt 1" in text
    assert run.attempt == 3 and [a.number for a in run.attempts] == [1, 2]
    assert [a.failure.message for a in run.attempts] == ["bad data in attempt 1", "bad data in attempt 2"]
    facts = run_facts(run.state)
    assert facts.attempt_text == "attempt 3 of 3" and len(facts.earlier) == 2
    assert "attempt 2: rank 1 on" in summary(run.state) and "(restarted)" in summary(run.state)
    # the run's default checkpoint directory goes with the run
    directory = run.directory._path
    assert os.path.isdir(os.path.join(directory, "checkpoints"))
    assert_no_survivors(run)
    del run, info, err
    _forget_runs()
    gc.collect()
    assert not os.path.exists(directory)


def test_a_restart_is_announced_by_the_text_view(capsys):
    from torchdist_magic import Distributor

    with pytest.raises(RankFailure):
        Distributor(2, show="text", max_restarts=1).run(fail_on_rank1)
    out = capsys.readouterr().out
    assert "torchdist: attempt 1 failed (rank 1 on " in out and "restarting: attempt 2 of 2" in out
    assert "torchdist: failed after" in out and ", attempt 2 of 2" in out
    _forget_runs()
    gc.collect()


# -- graceful stops --------------------------------------------------------------------------------
def loop_and_clean_up(marks, failing_rank):
    """Both ranks loop; ``failing_rank`` raises once both are looping (None: nobody does)."""
    import atexit

    atexit.register(touch, os.path.join(marks, f"atexit-{rank()}"))
    try:
        touch(os.path.join(marks, f"looping-{rank()}"))
        while True:
            if rank() == failing_rank and len(os.listdir(marks)) >= 2:
                raise RuntimeError("this rank fails")
            time.sleep(0.05)
    finally:
        touch(os.path.join(marks, f"finally-{rank()}"))


@pytest.mark.parametrize("how", ["peer failure", "timeout"])
def test_stopped_ranks_run_finally_blocks_and_atexit_handlers(local_distributor, tmp_path, how, run_clock):
    from torchdist_magic import JobTimeout

    marks = tmp_path / "marks"
    marks.mkdir()
    if how == "peer failure":
        run = local_distributor(2).submit(loop_and_clean_up, str(marks), 1)
        with pytest.raises(RankFailure, match="this rank fails"):
            run.result(timeout=120)
    else:
        run = local_distributor(2, timeout=600).submit(loop_and_clean_up, str(marks), None)
        wait_until(lambda: {"looping-0", "looping-1"} <= set(os.listdir(marks)), 120, "both ranks to loop")
        run_clock.expire()
        with pytest.raises(JobTimeout):
            run.result(timeout=120)
    assert {"finally-0", "finally-1", "atexit-0", "atexit-1"} <= set(os.listdir(marks))
    assert_no_survivors(run)


def napping():
    print("napping", flush=True)
    time.sleep(600)


NAP_LINE = inspect.getsourcelines(napping)[1] + 2


def test_a_timeout_shows_where_each_rank_was(local_distributor, run_clock):
    from torchdist_magic.view import html
    from torchdist_magic.view.model import rank_stacks
    from torchdist_magic.view.text import summary

    # it expires once both ranks are napping: the stacks are captured then
    run = local_distributor(2, timeout=600).submit(napping)
    wait_until(lambda: all("napping" in run.logs(r) for r in range(2)), 120, "both ranks to nap")
    run_clock.expire()
    with pytest.raises(TimeoutError) as info:
        run.result(timeout=120)
    for r in range(2):
        assert f"  rank {r}: napping ({__file__}, line {NAP_LINE})" in str(info.value)
    stacks = rank_stacks(run.state)
    assert [s.rank for s in stacks] == [0, 1] and all("thread 0x" in s.text.lower() for s in stacks)
    assert f"rank 1: napping ({__file__}, line {NAP_LINE})" in summary(run.state)
    page = html.summary_html(run.state)
    assert page.count('class="torchdist-rank-stack"') == 2 and "napping" in page
    assert_no_survivors(run)


def quiet_rank0():
    if rank() == 0:
        napping()


def test_a_hang_after_a_rank_finished_says_it_had_exited(local_distributor, monkeypatch):
    import threading

    from torchdist_magic import HangTimeout
    from torchdist_magic.driver.state import RunState

    # the run's quiet counts only from when rank 0 naps and rank 1 has exited
    counting, real_idle = threading.Event(), RunState.idle
    monkeypatch.setattr(RunState, "idle", lambda self: real_idle(self) if counting.is_set() else 0.0)
    run = local_distributor(2, hang_timeout=2).submit(quiet_rank0)
    wait_until(
        lambda: "napping" in run.logs(0) and run.state.ranks[1].exit_code == 0, 120, "rank 0 to nap once rank 1 exited"
    )
    counting.set()
    with pytest.raises(HangTimeout) as info:
        run.result(timeout=120)
    assert "  rank 1: had exited with code 0" in str(info.value)
    assert f"  rank 0: napping ({__file__}, line {NAP_LINE})" in str(info.value)
    assert_no_survivors(run)


def test_a_rank_is_not_signalled_before_it_can_take_the_stack_signal(tmp_path):
    """Before the worker's handler is in place, the stack signal would kill the rank."""
    import signal as signals

    from helpers import Collector, wait_until
    from torchdist_magic.launch.launcher import RankProcess, stop_all

    not_a_worker = tmp_path / "python"
    not_a_worker.write_text("#!/bin/sh\necho up\nexec sleep 600\n")
    not_a_worker.chmod(0o755)
    got = Collector()
    proc = RankProcess(0, "job", str(tmp_path / "rank-0"), dict(os.environ), got, python=str(not_a_worker))
    try:
        # its launcher also sends system samples: wait for the records meant, whatever came between
        wait_until(
            lambda: any(r.type == "log" and "up" in [o.line for o in r.lines()] for r in got.records),
            10,
            '"up": it runs',
        )
        proc.dump_stacks()
        wait_until(lambda: any(r.type == "stacks" for r in got.records), 10, "its stacks record")
        stacks = [r for r in got.wait_for(1) if r.type == "stacks"]
        assert stacks[0].note == "the rank had not started its job yet" and proc.alive()
    finally:
        stop_all([proc], 0.5)
    assert proc.returncode == -signals.SIGTERM


def test_timeout_and_hang_errors_name_every_rank_and_survive_pickling():
    import pickle

    from torchdist_magic import HangTimeout, JobTimeout
    from torchdist_magic.core.events import Stacks

    stacks = {
        0: Stacks(
            rank=0, text='Current thread 0x1 (most recent call first):\n  File "/a/t.py", line 5 in f\n', main_thread=1
        )
    }
    err = JobTimeout(5, "rank 0: running; rank 1: running", stacks, 2)
    assert str(err).endswith(
        "Where each rank was (innermost frame first):\n  rank 0: f (/a/t.py, line 5)\n  rank 1: no stack came back"
    )
    assert err._render_traceback_()[-2:] == [
        "--- rank 0, main thread (most recent call last) ---",
        '  File "/a/t.py", line 5, in f',
    ]
    hang = pickle.loads(pickle.dumps(HangTimeout(3, stacks, 2)))
    assert isinstance(hang, TimeoutError) and hang.stacks[0].where() == "f (/a/t.py, line 5)"
    assert str(hang) == str(HangTimeout(3, stacks, 2)) and str(pickle.loads(pickle.dumps(err))) == str(err)
    assert str(JobTimeout(5)) == "distributed run timed out after 5 s; every rank was stopped"


# -- progress from libraries -----------------------------------------------------------------------
def tqdm_loops():
    from tqdm import tqdm

    for _ in tqdm(range(50), desc="batches"):
        time.sleep(0.002)
    with tqdm(total=10, desc="eval", leave=False) as bar:  # gone when closed, as on a terminal
        bar.update(10)
    quiet = tqdm(range(3), desc="turned off", disable=True)  # a library's choice: no bar
    list(quiet)
    print("end", flush=True)


def test_tqdm_bars_are_each_ranks_progress_without_flooding_the_log(local_distributor):
    run = local_distributor(2).submit(tqdm_loops)
    run.result(timeout=120)
    for rs in run.state.ranks:
        (bar,) = rs.progress.values()
        assert (bar["desc"], bar["n"], bar["total"], bar["state"]) == ("batches", 50, 50, "done")
        log = run.logs(rs.rank)
        assert "\r" not in log and log.count("50/50") == 1  # the bar's final line, once
        assert "batches: 100%" in log and "eval" not in log and "end" in log.splitlines()  # (two pipes: either order)
    assert_no_survivors(run)


def rich_progress():
    from rich.progress import Progress

    with Progress() as progress:
        task = progress.add_task("[bold]steps", total=8)
        for _ in range(8):
            progress.update(task, advance=1)
        hidden = progress.add_task("hidden", total=2)
        progress.update(hidden, visible=False)


@needs("rich")
def test_rich_progress_tasks_are_progress_too(local_distributor):
    run = local_distributor(1).submit(rich_progress)
    run.result(timeout=120)
    (bar,) = run.state.ranks[0].progress.values()
    assert (bar["desc"], bar["n"], bar["total"], bar["state"]) == ("steps", 8, 8, "done")


def lightning_fit():
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import TQDMProgressBar
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _index):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class EveryRankBar(TQDMProgressBar):
        """Lightning draws its bar on rank 0 only; this one on every rank."""

        def setup(self, trainer, pl_module, stage):
            super().setup(trainer, pl_module, stage)
            self.enable()

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=5,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[EveryRankBar()],
    )
    trainer.fit(Regression(), data)
    return trainer.global_step


@needs("lightning")
def test_lightning_trainer_bars_are_each_ranks_progress(local_distributor):
    run = local_distributor(2).submit(lightning_fit)
    assert run.result(timeout=300) == 10
    for rs in run.state.ranks:
        bars = list(rs.progress.values())
        assert [(b["desc"], b["n"], b["total"], b["state"]) for b in bars] == [("Epoch 1", 5, 5, "done")]
        assert "loss=" in bars[0]["postfix"]
    assert_no_survivors(run)


def hf_trainer_fit(steps):
    import tempfile

    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    ids = torch.randint(5, 50, (64, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": int((i == 7).any())} for i in ids]
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            max_position_embeddings=16,
        )
    )
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=4,
            max_steps=steps,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=2,
            ddp_backend="gloo",
        )
        return Trainer(model=model, args=args, train_dataset=data).train().global_step


@needs("transformers", "accelerate")
def test_hf_trainer_bar_is_rank_zeros_progress(local_distributor):
    run = local_distributor(2).submit(hf_trainer_fit, 6)
    assert run.result(timeout=300) == 6
    (bar,) = run.state.ranks[0].progress.values()  # the Trainer draws its bar on the main process
    assert (bar["n"], bar["total"], bar["state"]) == (6, 6, "done")
    assert "\r" not in run.logs(0) and run.logs(0).count("6/6 [") == 1
    assert run.state.ranks[1].progress == {}
    assert_no_survivors(run)


# -- bounded driver memory -------------------------------------------------------------------------
def print_many(n):
    write = sys.stdout.write
    me = rank()
    for i in range(n):
        write(f"r{me} line {i}\n")
    return n


def _rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_million_lines_per_rank_spill_to_disk_and_all_come_back(local_distributor, record_property):
    lines = 1_000_000
    before = peak = _rss_mb()
    run = local_distributor(2).submit(print_many, lines)
    while not run.wait(0.2):
        peak = max(peak, _rss_mb())
    assert run.result() == lines
    growth = max(peak, _rss_mb()) - before
    record_property("driver_rss_growth_mb", round(growth, 1))
    print(f"\ndriver RSS growth for 2 x {lines:,} lines: {growth:.1f} MB")
    assert growth < 150, f"the driver's memory grew by {growth:.0f} MB"  # kept in memory it is ~500 MB
    for r in range(2):
        assert run.state.ranks[r].logs.spilled > lines // 2
        text = run.logs(r)
        assert text == "".join(f"r{r} line {i}\n" for i in range(lines))
    del text
    directory = run.directory._path
    assert os.listdir(os.path.join(directory, "logs")) == ["logs.spill"]  # every rank's, in one file
    assert_no_survivors(run)
    del run
    _forget_runs()
    gc.collect()
    assert not os.path.exists(directory)  # the spilled logs go with the run


# -- checkpoint helpers ----------------------------------------------------------------------------
@pytest.fixture
def in_a_run(monkeypatch, tmp_path):
    """This process as rank ``RANK`` of a run with a checkpoint directory; returns it."""
    directory = tmp_path / "checkpoints"
    for name, value in {
        "RANK": "0",
        "TORCHDIST_CHECKPOINT_DIR": str(directory),
        "TORCHDIST_KEEP_CHECKPOINTS": "2",
        "TORCHDIST_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    return directory


def test_checkpoints_are_numbered_kept_and_pruned(in_a_run):
    assert load_checkpoint() is None
    assert save_checkpoint({"step": 0}).endswith("checkpoint-000000000.pt")
    save_checkpoint({"step": 1})
    save_checkpoint({"step": 10}, step=10)
    assert sorted(os.listdir(in_a_run)) == ["checkpoint-000000001.pt", "checkpoint-000000010.pt"]  # keep 2
    assert load_checkpoint() == {"step": 10}
    save_checkpoint({"step": 11})
    assert load_checkpoint()["step"] == 11


def test_only_the_saving_rank_writes(in_a_run, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert save_checkpoint({"x": 1}) is None and not in_a_run.exists()
    assert save_checkpoint({"x": 1}, rank=1) is not None
    assert load_checkpoint() == {"x": 1}


def test_a_write_cut_short_leaves_the_last_checkpoint_and_its_debris_goes(in_a_run, monkeypatch):
    import torch

    save_checkpoint({"step": 1}, step=1)

    def killed(obj, fh):
        fh.write(b"half a checkpoint")
        raise KeyboardInterrupt  # the rank was stopped mid-write

    with monkeypatch.context() as patched:
        patched.setattr(torch, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint({"step": 2}, step=2)
    assert os.listdir(in_a_run) == ["checkpoint-000000001.pt"] and load_checkpoint() == {"step": 1}
    # a rank killed outright leaves its temporary file: the next attempt's save removes it
    (in_a_run / ".checkpoint-000000002.pt.tmp-a0-123").write_bytes(b"half")
    monkeypatch.setenv("TORCHDIST_RESTART_COUNT", "1")
    save_checkpoint({"step": 2}, step=2)
    assert sorted(os.listdir(in_a_run)) == ["checkpoint-000000001.pt", "checkpoint-000000002.pt"]


def save_without_a_directory():
    save_checkpoint({"x": 1})


def test_saving_in_a_run_without_a_checkpoint_directory_says_how_to_give_one(local_distributor):
    with pytest.raises(RankFailure) as info:
        local_distributor(1).run(save_without_a_directory)
    assert info.value.message == (
        "save_checkpoint: this run has no checkpoint directory; give it one (--checkpoint-dir, "
        "checkpoint_dir=), or restarts (--max-restarts: the run then has one of its own), or pass directory=..."
    )


def test_checkpoint_helpers_outside_a_run(monkeypatch, tmp_path):
    for name in (
        "TORCHDIST_CHECKPOINT_DIR",
        "TORCHDIST_RESTART_COUNT",
        "TORCHELASTIC_RESTART_COUNT",
        "RANK",
        "TORCHDIST_RUN_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    assert restart_count() == 0 and load_checkpoint() is None
    with pytest.raises(
        ValueError,
        match=r"^save_checkpoint needs a directory outside a run: pass directory=\.\.\., "
        r"or run it under %%torchdist / Distributor$",
    ):
        save_checkpoint({"x": 1})
    save_checkpoint({"x": 1}, directory=str(tmp_path / "c"))
    assert load_checkpoint(directory=str(tmp_path / "c")) == {"x": 1}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # under torchrun
    assert restart_count() == 2
    with pytest.raises(ValueError, match=r"^save_checkpoint: step must be a whole number of at least 0, got -1$"):
        save_checkpoint({}, step=-1, directory=str(tmp_path))


# -- what restarts do not undo: one timeout for every attempt; hangs and cancels end the run --------
def fail_the_first_attempt_when_told(marks):
    """Each attempt says it started and waits for its go; the first then fails, a later one
    finishes."""
    attempt = restart_count() + 1
    open(os.path.join(marks, f"attempt{attempt}-started"), "w").close()
    while not os.path.exists(os.path.join(marks, f"go{attempt}")):
        time.sleep(0.05)
    if attempt == 1:
        raise ValueError("attempt 1 failed late")
    open(os.path.join(marks, f"attempt{attempt}-finished"), "w").close()
    return attempt


def test_a_timeout_counts_for_all_attempts_together(local_distributor, tmp_path, run_clock):
    from torchdist_magic import JobTimeout

    # attempt 1 uses 400 of the 600 s; attempt 2 then has 200 s left, not a fresh 600
    run = local_distributor(1, timeout=600, max_restarts=3).submit(fail_the_first_attempt_when_told, str(tmp_path))
    try:
        wait_until(lambda: (tmp_path / "attempt1-started").exists(), 60, "attempt 1 to start")
        run_clock.advance(400)
        (tmp_path / "go1").touch()
        wait_until(lambda: (tmp_path / "attempt2-started").exists(), 60, "attempt 2 to start")
        run_clock.advance(300)
        with pytest.raises(JobTimeout) as info:
            run.result(timeout=120)
    finally:
        run.cancel()
        run.wait(60)
    assert info.value.headline == "distributed run timed out after 600 s; every rank was stopped"
    assert run.attempt == 2 and run.state.state == "timed out"
    assert [a.failure.message for a in run.attempts] == ["attempt 1 failed late"]
    assert not (tmp_path / "attempt2-finished").exists()  # cut short: no third attempt either
    assert_no_survivors(run)
    del run, info  # the run's directory (its default checkpoints) goes with the run
    _forget_runs()
    gc.collect()


def say_up_then_sleep(marks):
    open(os.path.join(marks, f"rank{rank()}-up"), "w").close()
    print("up", flush=True)
    time.sleep(600)


def test_a_hang_is_not_restarted_while_restarts_remain(local_distributor, tmp_path, run_clock):
    from torchdist_magic import HangTimeout

    run = local_distributor(2, hang_timeout=600, max_restarts=2).submit(say_up_then_sleep, str(tmp_path))
    try:
        # quiet from when both ranks are up, however long they took to start
        wait_until(lambda: all((tmp_path / f"rank{r}-up").exists() for r in (0, 1)), 120, "both ranks up")
        run_clock.expire()
        with pytest.raises(HangTimeout) as info:
            run.result(timeout=120)
    finally:
        run.cancel()
        run.wait(60)
    assert info.value.headline == (
        "no rank sent progress, metrics or output for 600 s (hang_timeout); every rank was stopped"
    )
    assert run.attempt == 1 and run.attempts == [] and run.state.state == "hung"
    assert "up" in run.logs(0) and "up" in run.logs(1)  # the ranks ran, then went quiet
    assert_no_survivors(run)
    del run, info
    _forget_runs()
    gc.collect()


def test_a_cancel_is_not_restarted_while_restarts_remain(local_distributor, tmp_path):
    from helpers import wait_until
    from torchdist_magic import RunCancelled

    run = local_distributor(2, max_restarts=2).submit(say_up_then_sleep, str(tmp_path))
    try:
        wait_until(lambda: all((tmp_path / f"rank{r}-up").exists() for r in range(2)), 60, "both ranks to start")
        run.cancel()
        with pytest.raises(RunCancelled, match=r"^the run was cancelled; every rank was stopped$"):
            run.result(timeout=120)
    finally:
        run.cancel()
        run.wait(60)
    assert run.attempt == 1 and run.attempts == [] and run.state.state == "cancelled"
    assert_no_survivors(run)
    del run
    _forget_runs()
    gc.collect()
