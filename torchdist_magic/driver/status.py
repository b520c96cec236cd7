"""A run's status for programs: one versioned dict of JSON values, built in one place
(``run_status``) from the run's state, which ``Run.status()``, ``AttachedRun.status()`` and
``torchdist status --json`` all return; and a failed or hung run explained (``explain``), which
``torchdist explain`` prints.

The dict's keys are stable within a ``schema`` version (``SCHEMA_VERSION``): a key is added in a
new version, never renamed or given another meaning in the same one.  ``STATUS_SCHEMA`` and
``EXPLAIN_SCHEMA`` describe them as JSON Schema (what the docs' page "From a terminal" shows and
the tests check every output against).  Values are JSON's own: numbers, strings, booleans,
``null``, lists and objects; a metric that is not a finite number is ``null``; times are Unix
seconds, durations seconds.

Both read the state only through its reads (``snapshot``; a rank's ``recent_log``), so a state
held by a supervising process (``feed.HostedState``) serves them as the run's own does.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from typing import Any, Dict, List, Optional

from ..core import culprit
from ..core.preflight import compare

#: the version of the dicts ``run_status`` and ``explain`` return (their ``"schema"`` key)
SCHEMA_VERSION = 2
#: lines of each rank involved that ``explain`` shows
EXPLAIN_LINES = 20
#: run states after which nothing more happens
ENDED_STATES = ("succeeded", "failed", "cancelled", "timed out", "hung")
#: those in which the run was stopped as a whole, not by a rank's failure
STOPPED_STATES = ("cancelled", "timed out", "hung")

_NUMBER = {"type": ["number", "null"]}
_BAR = {
    "type": ["object", "null"],
    "required": ["desc", "n", "total", "percent", "rate", "eta_s"],
    "additionalProperties": False,
    "properties": {
        "desc": {"type": "string"},
        "n": {"type": "integer"},
        "total": {"type": ["integer", "null"]},
        "percent": _NUMBER,
        "rate": _NUMBER,
        "eta_s": _NUMBER,
    },
}
_FAILURE = {
    "type": ["object", "null"],
    "required": ["rank", "host", "exit_code", "exc_type", "message", "summary"],
    "additionalProperties": False,
    "properties": {
        "rank": {"type": "integer"},
        "host": {"type": "string"},
        "exit_code": {"type": ["integer", "null"]},
        "exc_type": {"type": "string"},
        "message": {"type": "string"},
        "summary": {"type": "string"},
    },
}
_CULPRIT = {
    "type": ["object", "null"],
    "required": ["kind", "suspects", "sentence", "records"],
    "additionalProperties": False,
    "properties": {
        "kind": {"enum": ["behind", "exited", "mismatch"]},
        "suspects": {"type": "array", "items": {"type": "integer"}},
        "sentence": {"type": "string"},
        "records": {"type": "array", "items": {"type": "string"}},
    },
}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_FAULT = {
    "type": ["object", "null"],
    "required": ["kind", "why"],
    "additionalProperties": False,
    "properties": {"kind": {"enum": ["user", "machine", "lost", "hang"]}, "why": {"type": "string"}},
}
_EXCLUDED = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["host", "executor", "kind", "why", "attempt"],
        "additionalProperties": False,
        "properties": {
            "host": {"type": "string"},
            "executor": {"type": "string"},
            "kind": {"type": "string"},
            "why": {"type": "string"},
            "attempt": {"type": "integer"},
        },
    },
}

#: the status dict (``run_status``) as JSON Schema
STATUS_SCHEMA: Dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "torchdist run status",
    "type": "object",
    "additionalProperties": False,
    "required": [
        "schema",
        "run_id",
        "state",
        "finished",
        "job",
        "backend",
        "num_processes",
        "use_gpu",
        "started",
        "ended",
        "elapsed_s",
        "attempt",
        "max_attempts",
        "restarts",
        "progress",
        "metrics",
        "stragglers",
        "culprit",
        "root_cause",
        "message",
        "goodput",
        "ranks",
        "fault",
        "excluded",
    ],
    "properties": {
        "schema": {"const": SCHEMA_VERSION},
        "run_id": {"type": "string"},
        "state": {"enum": ["starting", "running", "restarting", *ENDED_STATES]},
        "finished": {"type": "boolean"},
        "job": {"type": "string"},
        "backend": {"type": "string"},
        "num_processes": {"type": "integer"},
        "use_gpu": {"type": "boolean"},
        "started": {"type": "number"},
        "ended": _NUMBER,
        "elapsed_s": {"type": "number"},
        "attempt": {"type": "integer"},
        "max_attempts": {"type": "integer"},
        "restarts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["attempt", "started", "ended", "root_cause", "fault", "world_size"],
                "additionalProperties": False,
                "properties": {
                    "attempt": {"type": "integer"},
                    "started": {"type": "number"},
                    "ended": {"type": "number"},
                    "root_cause": _FAILURE,
                    "fault": _FAULT,
                    "world_size": {"type": "integer"},
                },
            },
        },
        "progress": _BAR,
        "metrics": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["min", "median", "max", "ranks"],
                "additionalProperties": False,
                "properties": {"min": _NUMBER, "median": _NUMBER, "max": _NUMBER, "ranks": {"type": "integer"}},
            },
        },
        "stragglers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["rank", "host", "why"],
                "additionalProperties": False,
                "properties": {"rank": {"type": "integer"}, "host": {"type": "string"}, "why": {"type": "string"}},
            },
        },
        "culprit": _CULPRIT,
        "root_cause": _FAILURE,
        "message": {"type": "string"},
        "goodput": {"type": "object", "additionalProperties": {"type": "number"}},
        "fault": _FAULT,
        "excluded": _EXCLUDED,
        "ranks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "rank",
                    "host",
                    "pid",
                    "state",
                    "exit_code",
                    "progress",
                    "metrics",
                    "step_time_s",
                    "quiet_s",
                ],
                "additionalProperties": False,
                "properties": {
                    "rank": {"type": "integer"},
                    "host": {"type": "string"},
                    "pid": {"type": ["integer", "null"]},
                    "state": {"type": "string"},
                    "exit_code": {"type": ["integer", "null"]},
                    "progress": _BAR,
                    "metrics": {"type": "object", "additionalProperties": _NUMBER},
                    "step_time_s": _NUMBER,
                    "quiet_s": _NUMBER,
                },
            },
        },
    },
}

#: the explanation dict (``explain``) as JSON Schema
EXPLAIN_SCHEMA: Dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "torchdist run explanation",
    "type": "object",
    "additionalProperties": False,
    "required": [
        "schema",
        "run_id",
        "state",
        "headline",
        "root_cause",
        "fault",
        "attempts",
        "excluded",
        "culprit",
        "ranks",
        "preflight",
        "remedies",
    ],
    "properties": {
        "schema": {"const": SCHEMA_VERSION},
        "fault": _FAULT,
        "attempts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["attempt", "world_size", "fault", "summary"],
                "additionalProperties": False,
                "properties": {
                    "attempt": {"type": "integer"},
                    "world_size": {"type": "integer"},
                    "fault": _FAULT,
                    "summary": {"type": "string"},
                },
            },
        },
        "excluded": _EXCLUDED,
        "run_id": {"type": "string"},
        "state": {"type": "string"},
        "headline": {"type": "string"},
        "root_cause": {**_FAILURE, "properties": {**_FAILURE["properties"], "traceback": {"type": "string"}}},
        "culprit": _CULPRIT,
        "ranks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["rank", "why", "last_lines"],
                "additionalProperties": False,
                "properties": {"rank": {"type": "integer"}, "why": {"type": "string"}, "last_lines": _STRINGS},
            },
        },
        "preflight": {
            "type": ["object", "null"],
            "required": ["refusal", "warnings", "lines"],
            "additionalProperties": False,
            "properties": {"refusal": {"type": "string"}, "warnings": _STRINGS, "lines": _STRINGS},
        },
        "remedies": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["problem", "remedy"],
                "additionalProperties": False,
                "properties": {"problem": {"type": "string"}, "remedy": {"type": "string"}},
            },
        },
    },
}
EXPLAIN_SCHEMA["properties"]["root_cause"]["required"] = [*_FAILURE["required"], "traceback"]

#: one run of the history (``record_json``; ``torchdist runs --json`` prints a list of them)
RECORD_SCHEMA: Dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "torchdist run record",
    "type": "object",
    "additionalProperties": False,
    "required": [
        "schema",
        "run_id",
        "state",
        "outcome",
        "started",
        "ended",
        "duration_s",
        "backend",
        "num_processes",
        "detached",
        "job",
        "host",
        "root_cause",
        "failure",
        "fault",
        "excluded",
        "world_sizes",
    ],
    "properties": {
        "schema": {"const": SCHEMA_VERSION},
        "run_id": {"type": "string"},
        "state": {"enum": ["running", "succeeded", "failed", "cancelled"]},
        "outcome": {"type": "string"},
        "started": {"type": "number"},
        "ended": _NUMBER,
        "duration_s": {"type": "number"},
        "backend": {"type": "string"},
        "num_processes": {"type": "integer"},
        "detached": {"type": "boolean"},
        "job": {"type": "string"},
        "host": {"type": "string"},
        "root_cause": _FAILURE,
        "failure": {"type": "string"},
        "fault": {"type": "string"},
        "excluded": _STRINGS,
        "world_sizes": {"type": "array", "items": {"type": "integer"}},
    },
}

#: the known errors and what helps: ``(name, pattern over the failure's text, remedy)``
REMEDIES = (
    (
        "a collective timed out (NCCL or gloo)",
        re.compile(
            r"Timed out waiting \d+ ?ms|collective operation timeout|Watchdog caught|DistBackendError|"
            r"NCCL (error|timeout)|ProcessGroupNCCL|ProcessGroupGloo",
            re.I,
        ),
        "a collective waits for every rank: look at the culprit (the rank behind, exited or in another "
        "collective) rather than at the ranks that timed out; where a rank is legitimately slow (a "
        "long evaluation on rank 0), raise the process group's timeout "
        "(init_process_group(timeout=datetime.timedelta(...))) or give the others the same work",
    ),
    (
        "a rank ran out of memory",
        re.compile(r"OutOfMemoryError|CUDA out of memory|MemoryError|SIGKILL|\boom\b", re.I),
        "lower the batch size per rank, use mixed precision or gradient checkpointing, run fewer "
        "ranks per machine (--np) or free what the notebook holds; a rank killed by SIGKILL with no "
        "traceback was most often the kernel's out-of-memory killer (dmesg says)",
    ),
    (
        "a rank never joined",
        re.compile(r"never (joined|started)|did not start|rendezvous|connect(ion)? (refused|timed out)", re.I),
        "a rank that never joined leaves the others waiting in init_process_group: check that every "
        "host reaches MASTER_ADDR/MASTER_PORT, that the executors have slots for --np ranks, and the "
        "rank's own first lines (an import error, a missing package on that host)",
    ),
    (
        "a value could not be pickled",
        re.compile(r"pickl|PicklingError|Can't pickle|cannot pickle", re.I),
        "what the ranks receive or return must pickle: open files, locks, sockets, generators and "
        "live connections cannot; make them inside the job, or return plain values (a state_dict, "
        "numbers) instead of the objects that hold them",
    ),
)
HANG_REMEDY = (
    "the run hung",
    "no rank sent output, progress or metrics for --hang-timeout seconds: the culprit is where the "
    "others wait; a rank behind waits in its own code (a data loader, a lock, input()), a rank in "
    "another collective calls them in another order (a collective under `if rank == 0:`)",
)


def _number(value: Any) -> Optional[float]:
    """``value`` as a JSON number, or None where it is not a finite one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _bar(bar: Optional[dict], ended: bool = False) -> Optional[Dict[str, Any]]:
    """A progress bar in JSON: its steps, percent done, steps per second and the seconds left at
    that rate (None where unknown, and once the run has ``ended``)."""
    if not bar:
        return None
    n = int(bar.get("n") or 0)
    total = bar.get("total")
    total = int(total) if isinstance(total, (int, float)) and not isinstance(total, bool) and total > 0 else None
    elapsed = _number(bar.get("elapsed")) or 0.0
    rate = n / elapsed if n and elapsed > 0 else None
    return {
        "desc": str(bar.get("desc") or ""),
        "n": n,
        "total": total,
        "percent": round(100.0 * n / total, 2) if total else None,
        "rate": rate,
        "eta_s": max(total - n, 0) / rate if total and rate and not ended else None,
    }


def failure_json(failure: Any, traceback: bool = False) -> Optional[Dict[str, Any]]:
    """A rank's ``Failure`` in JSON (with its traceback when asked), or None."""
    if failure is None:
        return None
    data = {
        "rank": failure.rank,
        "host": failure.host or "",
        "exit_code": failure.exit_code,
        "exc_type": failure.exc_type or "",
        "message": failure.message or "",
        "summary": failure.summary(),
    }
    if traceback:
        data["traceback"] = failure.traceback or ""
    return data


def _culprit_json(verdict: Any) -> Optional[Dict[str, Any]]:
    if not verdict:
        return None
    return {
        "kind": verdict.kind,
        "suspects": list(verdict.suspects),
        "sentence": verdict.sentence,
        "records": list(verdict.summary),
    }


def _run_progress(outer: List[Optional[dict]], ended: bool) -> Optional[Dict[str, Any]]:
    """The run's progress: its outermost bar with a total on the rank furthest behind (the run
    ends when that rank does)."""
    bars = [_bar(bar, ended) for bar in outer if bar]
    counted = [b for b in bars if b["total"]]
    if counted:
        return min(counted, key=lambda b: (b["percent"], b["n"]))
    return min(bars, key=lambda b: b["n"]) if bars else None


def _spread(ranks: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Each metric's last value across ranks: min, median, max and how many ranks reported it."""
    columns: Dict[str, List[float]] = {}
    for rank in ranks:
        for name, value in rank["metrics"].items():
            if value is not None:
                columns.setdefault(name, []).append(value)
    return {
        name: {"min": min(values), "median": statistics.median(values), "max": max(values), "ranks": len(values)}
        for name, values in sorted(columns.items())
    }


def _failures(snap: Any) -> list:
    """The failed ranks, root cause first; none once a hang, a timeout or a stop ended the run:
    a rank that fails while the others are being stopped (a peer's connection closed) is not
    why the run ended."""
    return [] if snap.state in STOPPED_STATES else snap.failures()


def run_status(state: Any) -> Dict[str, Any]:
    """The status of the run whose state is ``state`` (a ``RunState``, or the ``HostedState`` of a
    detached run), as ``STATUS_SCHEMA`` describes it.

    Example:

    ```python
    import json
    from torchdist_magic import attach, runs

    print(json.dumps(attach(runs()[0].run_id).status(), indent=1))
    ```
    """
    snap = state.snapshot()
    quiet = list(snap.quiet) + [None] * (snap.num_processes - len(snap.quiet))
    ranks, outer = [], []
    for rs in snap.ranks:
        shown = rs.shown_progress()
        outer.append(shown[0] if shown else None)
        ranks.append(
            {
                "rank": rs.rank,
                "host": rs.host or "",
                "pid": rs.pid,
                "state": rs.state,
                "exit_code": rs.exit_code,
                "progress": _bar(rs.current_progress(), snap.finished),
                "metrics": {str(name): _number(value) for name, value in rs.metrics.items()},
                "step_time_s": _number(rs.step_time),
                "quiet_s": None if snap.finished else _number(quiet[rs.rank]),
            }
        )
    failures = _failures(snap)
    return {
        "schema": SCHEMA_VERSION,
        "run_id": snap.run_id,
        "state": snap.state,
        "finished": snap.finished,
        "job": snap.job_name or "",
        "backend": snap.backend or "",
        "num_processes": snap.num_processes,
        "use_gpu": bool(snap.use_gpu),
        "started": snap.started,
        "ended": snap.ended,
        "elapsed_s": max(snap.elapsed(), 0.0),
        "attempt": snap.attempt,
        "max_attempts": snap.max_attempts,
        "restarts": [
            {
                "attempt": a.number,
                "started": a.started,
                "ended": a.ended,
                "root_cause": failure_json(a.failure),
                "fault": fault_json(a.fault),
                "world_size": a.world_size,
            }
            for a in snap.attempts
        ],
        "progress": _run_progress(outer, snap.finished),
        "metrics": _spread(ranks),
        "stragglers": [{"rank": s.rank, "host": s.host or "", "why": s.why} for s in snap.stragglers],
        "culprit": _culprit_json(_verdict(state, snap)),
        "root_cause": failure_json(snap.failure or (failures[0] if failures else None)),
        "message": snap.message or "",
        "goodput": {key: float(value) for key, value in snap.goodput.items() if _number(value) is not None},
        "ranks": ranks,
        "fault": fault_json(snap.fault),
        "excluded": excluded_json(snap.excluded),
    }


def fault_json(fault: Any) -> Optional[Dict[str, str]]:
    """A root cause's class (``faults.Fault``) as ``{"kind", "why"}``; ``None`` for none."""
    return None if fault is None else {"kind": fault.kind, "why": fault.why}


def excluded_json(excluded: Any) -> List[Dict[str, Any]]:
    """The hosts a run's restarts left out (``faults.Exclusion``), oldest first."""
    return [
        {"host": e.host, "executor": e.executor, "kind": e.kind, "why": e.why, "attempt": e.attempt} for e in excluded
    ]


def record_json(record: Any, now: Optional[float] = None) -> Dict[str, Any]:
    """A run's record of the history (``history.RunRecord``) as ``RECORD_SCHEMA`` describes it:
    ``outcome`` is the run's own end (``hung``, ``timed out``: a ``failed`` state), "" while it
    runs."""
    now = time.time() if now is None else now
    return {
        "schema": SCHEMA_VERSION,
        "run_id": record.run_id,
        "state": record.state,
        "outcome": record.outcome or ("" if record.state == "running" else record.state),
        "started": record.started,
        "ended": record.ended,
        "duration_s": max((record.ended or now) - record.started, 0.0),
        "backend": record.backend or "",
        "num_processes": record.num_processes,
        "detached": bool(record.detached),
        "job": record.job_name or "",
        "host": record.host or "",
        "root_cause": failure_json(record.root_cause),
        "failure": record.failure or "",
        "fault": record.fault,
        "excluded": list(record.excluded),
        "world_sizes": list(record.world_sizes),
    }


def _verdict(state: Any, snap: Any) -> Any:
    """What the ranks' collective records say: the state's verdict, else (a state rebuilt from a
    journal keeps the records, not the verdict) the records compared here."""
    if snap.verdict:
        return snap.verdict
    records = getattr(state, "collectives", None)
    if not records:
        return None
    # every rank has exited by now (stopped): those that had when the records were asked for are
    # the ones that sent no stacks then (each running rank's stacks are records of the journal)
    exited = {
        rs.rank: f"exited with code {rs.exit_code}"
        for rs in snap.ranks
        if rs.exit_code is not None and snap.stacks and rs.rank not in snap.stacks
    }
    return culprit.verdict(dict(records), range(snap.num_processes), exited) or None


def explain(state: Any, lines: int = EXPLAIN_LINES) -> Dict[str, Any]:
    """Why the run of ``state`` failed or hung, as ``EXPLAIN_SCHEMA`` describes it: the root
    cause and its rank, the culprit with the collective records that name it, the last
    ``lines`` lines of each rank involved, what the pre-flight found, and the known remedies
    for the errors seen."""
    snap = state.snapshot()
    failures = _failures(snap)
    cause = snap.failure or (failures[0] if failures else None)
    verdict = _verdict(state, snap)
    involved: Dict[int, str] = {}
    if cause is not None:
        involved[cause.rank] = "root cause"
    for rank in verdict.suspects if verdict else ():
        involved.setdefault(rank, f"culprit ({verdict.kind})")
    for failure in failures:
        involved.setdefault(failure.rank, "failed after the root cause")
    ranks = []
    for rank, why in sorted(involved.items()):
        read = state.recent_log(rank, lines)
        ranks.append({"rank": rank, "why": why, "last_lines": [line.text for line in read.lines][-lines:]})
    preflight = compare(list(snap.preflight.values())) if snap.preflight else None
    text = "\n".join(
        [snap.message or ""]
        + [f"{f.exc_type} {f.message} {f.signal_name or ''} {' '.join(f.log_tail)}" for f in failures]
    )
    remedies = [{"problem": name, "remedy": remedy} for name, pattern, remedy in REMEDIES if pattern.search(text)]
    if snap.state == "hung":
        remedies.insert(0, {"problem": HANG_REMEDY[0], "remedy": HANG_REMEDY[1]})
    if verdict and verdict.kind == "exited" and not any(r["problem"] == "a rank never joined" for r in remedies):
        remedies += [{"problem": name, "remedy": remedy} for name, _, remedy in REMEDIES if "joined" in name]
    if verdict:
        headline = verdict.sentence[:1].upper() + verdict.sentence[1:]
    elif cause is not None:
        headline = cause.summary()
    elif snap.state == "succeeded":
        headline = "the run succeeded: there is no failure to explain"
    elif snap.state in ENDED_STATES:
        headline = snap.message or f"the run {snap.state}"
    else:
        headline = f"the run is {snap.state}: nothing has failed so far"
    return {
        "schema": SCHEMA_VERSION,
        "run_id": snap.run_id,
        "state": snap.state,
        "headline": headline,
        "root_cause": failure_json(cause, traceback=True),
        "fault": fault_json(snap.fault),
        "attempts": [
            {
                "attempt": a.number,
                "world_size": a.world_size,
                "fault": fault_json(a.fault),
                "summary": a.failure.summary() if a.failure else "",
            }
            for a in snap.attempts
        ],
        "excluded": excluded_json(snap.excluded),
        "culprit": _culprit_json(verdict),
        "ranks": ranks,
        "preflight": None
        if preflight is None
        else {"refusal": preflight.refusal, "warnings": list(preflight.warnings), "lines": list(preflight.lines)},
        "remedies": remedies,
    }
