"""The ``torchdist`` command (also ``python -m torchdist_magic``): a script as ranks, and the
history of runs, from a terminal.

Thin by design, as the magic is: each command parses its words and calls the public API
(``Distributor(...).run``, ``runs()``, ``attach()``, ``stop()``, a handle's ``status()``,
``logs()`` and ``state``); what it prints of a run's status is ``driver.status``'s dict, the
one the notebook's handle returns too.  ``torchdist run`` takes the magic's own flags,
generated from ``LaunchOptions`` (``core.flags.flag_specs``) less those that name notebook
variables.

Exit status, as torchrun's: 0 when the run succeeded, 1 when it failed (the root-cause rank's
traceback on stderr), hung, timed out or was stopped; 2 for a usage error (nothing started);
130 after Ctrl-C.  ``attach`` and ``status --watch`` end with the run's own status.

A run id may be shortened to any prefix that only one run's id starts with.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Sequence

#: flags of the magic that name a notebook's variables: a terminal has none
NOTEBOOK_FLAGS = ("--out", "--data", "--columns")
#: exit statuses
OK, FAILED, USAGE, INTERRUPTED = 0, 1, 2, 130
#: seconds between two looks of ``status --watch``, ``logs --follow`` and ``attach``
WATCH_EVERY = 2.0
FOLLOW_EVERY = 0.5
#: run ids a wrong or ambiguous id's message names
IDS_SHOWN = 10
#: above this many ranks, ``status`` shows the spread of their metrics, not a line per rank
RANK_LINES = 16


class UsageError(Exception):
    """A command's words are wrong: said on stderr, exit status 2, nothing started."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        # no abbreviated flags: a script's own arguments (``run x.py --b``) are never taken for
        # one of ours (``--backend``), nor refused as ambiguous between two of ours
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")


def parser() -> argparse.ArgumentParser:
    """The ``torchdist`` command's parser, with a subcommand each."""
    from .core.flags import flag_specs

    top = _Parser(
        prog="torchdist",
        description="Run a script as distributed PyTorch ranks, and look after runs from a terminal.",
    )
    sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = sub.add_parser(
        "run",
        help="run a script as ranks (the magic's flags), showing them as they go",
        description="Run script.py as ranks with the magic's own flags; exit status 1 when a rank "
        "failed, with the root-cause rank's traceback on stderr.",
    )
    for names, kwargs in flag_specs():
        if not set(names) & set(NOTEBOOK_FLAGS):
            run.add_argument(*names, **dict(kwargs, help=(kwargs.get("help") or "").replace("line form only: ", "")))
    runs = sub.add_parser("runs", help="the history of runs, newest first")
    runs.add_argument("--json", action="store_true", help="one JSON object per run (a list)")
    status = sub.add_parser("status", help="a run's progress, metrics, stragglers, culprit, goodput and ranks")
    status.add_argument("run_id", metavar="RUN", help="a run id, or a prefix of one")
    status.add_argument("--json", action="store_true", help="the status as JSON (schema in the docs)")
    status.add_argument("--watch", action="store_true", help="show it again every few seconds until the run ends")
    status.add_argument(
        "--interval", type=float, default=WATCH_EVERY, metavar="S", help="seconds between looks with --watch"
    )
    logs = sub.add_parser("logs", help="what a rank printed")
    logs.add_argument("run_id", metavar="RUN", help="a run id, or a prefix of one")
    logs.add_argument("--rank", type=int, default=0, metavar="R", help="the rank (default 0)")
    logs.add_argument("--attempt", type=int, default=None, metavar="A", help="one attempt only (1 for the first)")
    logs.add_argument("--follow", "-f", action="store_true", help="go on printing new lines until the run ends")
    logs.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N lines")
    attach = sub.add_parser("attach", help="follow a detached run's live view (Ctrl-C leaves it running)")
    attach.add_argument("run_id", metavar="RUN", help="a run id, or a prefix of one")
    stop = sub.add_parser("stop", help="stop a detached run (every rank)")
    stop.add_argument("run_id", metavar="RUN", help="a run id, or a prefix of one")
    explain = sub.add_parser("explain", help="why a run failed or hung, and what helps")
    explain.add_argument("run_id", metavar="RUN", help="a run id, or a prefix of one")
    explain.add_argument("--json", action="store_true", help="the explanation as JSON (schema in the docs)")
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``torchdist`` with ``argv`` (the process's own arguments by default); the exit status."""
    try:
        args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.command is None:
            raise UsageError("torchdist: give a command: run, runs, status, logs, attach, stop or explain (--help)")
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:  # `torchdist logs RUN | head`: the reader went away
        sys.stderr.close()
        return OK


# -- run ----------------------------------------------------------------------------------------
def _run(args: argparse.Namespace) -> int:
    from . import Distributor, LaunchOptions
    from .core.flags import FlagError, options_from_flags
    from .core.options import OptionError

    if args.script is None:
        raise UsageError("torchdist run: give a script to run (torchdist run [flags] script.py [args...])")
    chosen = [flag for flag, on in (("--local", args.local), ("--spark", args.spark)) if on]
    if len(chosen) == 2:
        raise UsageError("torchdist run: --local and --spark contradict each other: give one")
    if chosen:
        if args.backend is not None and args.backend != chosen[0][2:]:
            raise UsageError(f"torchdist run: {chosen[0]} and --backend {args.backend} contradict each other")
        args.backend = chosen[0][2:]
    try:
        options = options_from_flags(args, LaunchOptions())
        distributor = Distributor.from_options(options, show=None if args.quiet or options.detach else "text")
    except (FlagError, OptionError) as exc:
        raise UsageError(f"torchdist run: {exc}") from None
    script_args = tuple(args.script_args or ())
    if options.detach:
        try:
            handle = distributor.run(args.script, *script_args)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"torchdist run: {exc}") from None
        print(handle.run_id)
        print(
            f"torchdist: detached run {handle.run_id} started (np={options.num_processes}); "
            f"torchdist status {handle.run_id} shows it, torchdist attach {handle.run_id} follows it, "
            f"torchdist stop {handle.run_id} stops it",
            file=sys.stderr,
        )
        return OK
    from .core.errors import HangTimeout, JobTimeout, RankFailure, RunCancelled

    try:
        value = distributor.run(args.script, *script_args)
    except (TypeError, ValueError) as exc:  # refused before anything started
        raise UsageError(f"torchdist run: {exc}") from None
    except RankFailure as exc:
        print(exc.details(), file=sys.stderr)
        return FAILED
    except (HangTimeout, JobTimeout, RunCancelled) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:  # every rank was stopped (Distributor.run)
        print("torchdist: interrupted; every rank was stopped", file=sys.stderr)
        return INTERRUPTED
    if value is not None:
        print(repr(value))
    return OK


# -- the history ------------------------------------------------------------------------------
def resolve(run_id: str, records: Optional[List[Any]] = None) -> Any:
    """The record of the run whose id is ``run_id`` or starts with it; ``UsageError`` naming
    the ids there are when none or several do."""
    from . import runs

    records = runs() if records is None else records
    exact = [r for r in records if r.run_id == run_id]
    found = exact or [r for r in records if run_id and r.run_id.startswith(run_id)]
    if len(found) == 1:
        return found[0]
    ids = [r.run_id for r in (found or records)]
    shown = ", ".join(ids[:IDS_SHOWN]) + (f" and {len(ids) - IDS_SHOWN} more" if len(ids) > IDS_SHOWN else "")
    if found:
        raise UsageError(f"torchdist: run id {run_id!r} is ambiguous: {len(found)} runs start with it ({shown})")
    if not records:
        raise UsageError(f"torchdist: no run {run_id!r}: no run was recorded yet")
    raise UsageError(f"torchdist: no run {run_id!r}; the runs are (newest first): {shown}")


def _handle(record: Any) -> Any:
    """A handle whose ``state`` and ``logs`` tell the run: a detached run's (``attach``), else
    the state its record kept (a run of a kernel or of ``torchdist run``)."""
    from . import attach

    if record.detached:
        return attach(record.run_id)
    from .handles.attach import recorded_state

    return _Recorded(record, recorded_state(record))


class _Recorded:
    """What a record of a run that was not detached gives: its state and its logs as kept."""

    def __init__(self, record: Any, state: Any):
        self.record, self.state, self.run_id = record, state, record.run_id

    def status(self) -> Dict[str, Any]:
        from .driver.status import run_status

        return run_status(self.state)

    def logs(self, rank: int, attempt: Optional[int] = None) -> str:
        if attempt is not None:
            raise UsageError(
                f"torchdist logs: run {self.run_id} was not detached: its record keeps each rank's "
                "last lines, not its attempts; leave out --attempt"
            )
        return self.record.log(rank)

    def done(self) -> bool:
        return True

    def wait(self, timeout: Optional[float] = None) -> bool:
        return True


def _runs(args: argparse.Namespace) -> int:
    from . import runs
    from .driver.history import runs_table
    from .driver.status import record_json

    records = runs()
    if args.json:
        print(json.dumps([record_json(r) for r in records], indent=1))
    else:
        print(runs_table(records))
    return OK


# -- status -------------------------------------------------------------------------------------
def _status(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise UsageError(f"torchdist status: --interval must be a positive number of seconds, got {args.interval:g}")
    handle = _handle(resolve(args.run_id))
    tty = sys.stdout.isatty()
    while True:
        status = handle.status()
        if args.json:
            print(json.dumps(status, indent=None if args.watch else 1), flush=True)
        else:
            if args.watch and tty:
                sys.stdout.write("\x1b[H\x1b[J")  # the screen redrawn in place
            print(status_text(status), flush=True)
            if args.watch and not tty:
                print(flush=True)
        if not args.watch or status["finished"]:
            return (OK if status["state"] == "succeeded" else FAILED) if args.watch else OK
        handle.wait(args.interval)


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


def _bar_text(bar: Optional[Dict[str, Any]]) -> str:
    if not bar:
        return ""
    steps = f"{bar['n']}/{bar['total']} ({bar['percent']:.0f}%)" if bar["total"] else f"{bar['n']}"
    rate = f", {bar['rate']:.2f} steps/s" if bar["rate"] else ""
    eta = f", ETA {_duration(bar['eta_s'])}" if bar["eta_s"] is not None and bar["total"] else ""
    return f"{bar['desc'] + ' ' if bar['desc'] else ''}{steps}{rate}{eta}"


def _number_text(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4g}"


def status_text(status: Dict[str, Any]) -> str:
    """``torchdist status``'s text: what the status dict says, a line a fact."""
    rows = [
        f"run {status['run_id']}  {status['state']}  {_duration(status['elapsed_s'])}  "
        f"np={status['num_processes']} on {status['backend']}"
        + (f"  job {status['job']}" if status["job"] else "")
        + (f"  attempt {status['attempt']} of {status['max_attempts']}" if status["max_attempts"] > 1 else "")
    ]
    if status["progress"]:
        rows.append(f"progress: {_bar_text(status['progress'])}")
    if status["metrics"]:
        spread = [
            f"{name} {_number_text(m['median'])}"
            + (f" [{_number_text(m['min'])}..{_number_text(m['max'])}]" if m["min"] != m["max"] else "")
            for name, m in status["metrics"].items()
        ]
        rows.append("metrics (median [min..max] across ranks): " + "  ".join(spread))
    rows += [
        f"straggler: rank {s['rank']}{' on ' + s['host'] if s['host'] else ''}: {s['why']}"
        for s in status["stragglers"]
    ]
    if status["culprit"]:
        rows.append(f"culprit: {status['culprit']['sentence']}")
    if status["root_cause"]:
        rows.append(f"root cause: {status['root_cause']['summary']}")
    elif status["message"]:
        rows.append(status["message"].splitlines()[0])
    rows += [
        f"restart: attempt {a['attempt']} ended: {a['root_cause']['summary'] if a['root_cause'] else 'failed'}"
        for a in status["restarts"]
    ]
    goodput = status["goodput"]
    if goodput.get("wall_s") and (goodput.get("training_s") or not status["finished"]):
        rows.append(
            f"goodput: training {100 * goodput.get('training_s', 0.0) / goodput['wall_s']:.0f}% of "
            f"{_duration(goodput['wall_s'])} (startup {goodput.get('startup_s', 0.0):.1f} s, "
            f"lost to restarts {goodput.get('lost_to_restarts_s', 0.0):.1f} s, "
            f"to hangs {goodput.get('lost_to_hangs_s', 0.0):.1f} s)"
        )
    ranks = status["ranks"]
    if len(ranks) > RANK_LINES:
        counts: Dict[str, int] = {}
        for r in ranks:
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        rows.append("ranks: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
    else:
        for r in ranks:
            bits = [f"  rank {r['rank']}", r["state"]]
            bits += [f"host={r['host']}"] if r["host"] else []
            bits += [f"exit={r['exit_code']}"] if r["exit_code"] is not None else []
            bits += [_bar_text(r["progress"])] if r["progress"] else []
            bits += [" ".join(f"{k}={_number_text(v)}" for k, v in r["metrics"].items())] if r["metrics"] else []
            bits += [f"quiet {r['quiet_s']:.0f} s"] if r["quiet_s"] is not None and r["quiet_s"] >= 10 else []
            rows.append("  ".join(bits))
    return "\n".join(rows)


# -- logs -------------------------------------------------------------------------------------
def _logs(args: argparse.Namespace) -> int:
    if args.tail is not None and args.tail < 0:
        raise UsageError(f"torchdist logs: --tail takes a number of lines, 0 or more; got {args.tail}")
    record = resolve(args.run_id)
    if not 0 <= args.rank < record.num_processes:
        raise UsageError(
            f"torchdist logs: run {record.run_id} has ranks 0 to {record.num_processes - 1}; got --rank {args.rank}"
        )
    if args.attempt is not None and args.attempt < 1:
        raise UsageError(f"torchdist logs: --attempt counts from 1 (the first attempt); got {args.attempt}")
    handle = _handle(record)
    text = handle.logs(args.rank, args.attempt)
    if args.tail is not None:
        lines = text.splitlines(keepends=True)
        shown = "".join(lines[len(lines) - args.tail :] if args.tail else [])
    else:
        shown = text
    sys.stdout.write(shown)
    sys.stdout.flush()
    while args.follow:
        ended = handle.wait(FOLLOW_EVERY)
        newer = handle.logs(args.rank, args.attempt)
        sys.stdout.write(newer[len(text) :] if newer.startswith(text) else newer)
        sys.stdout.flush()
        text = newer
        if ended:
            break
    return OK


# -- attach, stop ---------------------------------------------------------------------------
def _attach(args: argparse.Namespace) -> int:
    from .core.errors import RankFailure
    from .view.text import TextView

    record = resolve(args.run_id)
    if not record.detached:
        raise UsageError(
            f"torchdist attach: run {record.run_id} was not detached: it ran in the process (pid "
            f"{record.pid}) that started it; torchdist status {record.run_id} and torchdist logs "
            f"{record.run_id} show what its record kept"
        )
    handle = _handle(record)
    view = TextView(handle.state)
    try:
        while not handle.wait(0.1):
            view.update()
    except KeyboardInterrupt:
        handle.detach()
        handle.release()
        print(
            f"torchdist: stopped following run {record.run_id}, which goes on (torchdist attach "
            f"{record.run_id} follows it again, torchdist stop {record.run_id} stops it)",
            file=sys.stderr,
        )
        return INTERRUPTED
    view.close()
    handle.release()
    for note in handle.notes:
        print(f"torchdist: {note}", file=sys.stderr)
    error = handle.exception  # the value stays in the record, for a kernel to take
    if error is None:
        return OK
    print(error.details() if isinstance(error, RankFailure) else f"{type(error).__name__}: {error}", file=sys.stderr)
    return FAILED


def _stop(args: argparse.Namespace) -> int:
    from . import stop

    record = resolve(args.run_id)
    try:
        stopping = stop(record.run_id, by="torchdist stop")
    except (ValueError, PermissionError) as exc:
        print(f"torchdist stop: {exc}", file=sys.stderr)
        return FAILED
    print(f"torchdist: run {record.run_id} {'is stopping' if stopping else 'had ended already'}")
    return OK


# -- explain ------------------------------------------------------------------------------------
def _explain(args: argparse.Namespace) -> int:
    from .driver.status import explain

    handle = _handle(resolve(args.run_id))
    found = explain(handle.state)
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        print(explain_text(found))
    return OK


def explain_text(found: Dict[str, Any]) -> str:
    """``torchdist explain``'s text: what the explanation dict says."""
    rows = [f"run {found['run_id']} {found['state']}: {found['headline']}"]
    cause = found["root_cause"]
    if cause:
        rows += ["", f"root cause: {cause['summary']}"]
        if found["fault"]:
            rows += [f"fault: {found['fault']['kind']} ({found['fault']['why']})"]
        if cause["traceback"].strip():
            rows += ["", f"--- traceback of rank {cause['rank']} ---", cause["traceback"].rstrip()]
    if found["attempts"]:
        rows += ["", "earlier attempts:"]
        rows += [
            f"  attempt {a['attempt']} on {a['world_size']} ranks: {a['summary'] or 'failed'}"
            + (f" [{a['fault']['kind']} fault]" if a["fault"] else "")
            for a in found["attempts"]
        ]
    if found["excluded"]:
        rows += ["", "left out by the restarts:"]
        rows += [
            "  "
            + (f"executor {e['executor']} on {e['host']}" if e["executor"] else e["host"])
            + f" after attempt {e['attempt']}: {e['kind']} fault, {e['why']}"
            for e in found["excluded"]
        ]
    if found["culprit"]:
        rows += ["", f"culprit: {found['culprit']['sentence']}", "collective records:"]
        rows += [f"  {line}" for line in found["culprit"]["records"]]
    for rank in found["ranks"]:
        rows += ["", f"--- last lines of rank {rank['rank']} ({rank['why']}) ---"]
        rows += rank["last_lines"] or ["(no output)"]
    preflight = found["preflight"]
    if preflight:
        rows += ["", "pre-flight:"]
        rows += [f"  {line}" for line in ([preflight["refusal"]] if preflight["refusal"] else [])]
        rows += [f"  warning: {line}" for line in preflight["warnings"]]
        rows += [f"  {line}" for line in preflight["lines"]]
    if found["remedies"]:
        rows += ["", "what helps:"]
        rows += [f"  {r['problem']}: {r['remedy']}" for r in found["remedies"]]
    return "\n".join(rows)


COMMANDS = {
    "run": _run,
    "runs": _runs,
    "status": _status,
    "logs": _logs,
    "attach": _attach,
    "stop": _stop,
    "explain": _explain,
}


def console() -> None:
    """The ``torchdist`` console script's entry point."""
    sys.exit(main())
