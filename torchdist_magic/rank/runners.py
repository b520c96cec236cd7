"""How each kind of job runs in a rank (``RUNNERS``, ``run_cell``): a function with its arguments, a
script as ``__main__``, or a notebook cell, with the notebook's imports replayed, its values
loaded and the run's process group set up around it and torn down after it."""

from __future__ import annotations

import ast
import linecache
import os
import socket
import sys
from typing import Optional


class CellImportError(ImportError):
    """An import statement replayed from the notebook failed on this rank."""


def _run_function(job):
    from torchdist_magic.core import values

    from torchdist_magic.rank import runtime

    fn, args, kwargs = values.loads_apart(job.payload, job.buffers)
    runtime._code_started()
    return fn(*args, **kwargs)


def _run_script(job):
    sys.argv = [job.script_path, *job.script_args]
    sys.path.insert(0, os.path.dirname(job.script_path))
    source = job.script_source
    if os.path.isfile(job.script_path):
        with open(job.script_path, encoding="utf-8") as fh:
            source = fh.read()
    namespace = {"__name__": "__main__", "__file__": job.script_path, "__builtins__": __builtins__}
    code = compile(source, job.script_path, "exec")
    from torchdist_magic.rank import runtime

    runtime._code_started()
    exec(code, namespace)
    return None


def cell_namespace() -> dict:
    from torchdist_magic.rank import shell as rank_shell, runtime

    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    ns.update(runtime.cell_names())
    ns["get_ipython"] = rank_shell.RankShell().get_ipython  # what the cell's !cmd and %magics call
    return ns


def _init_once(dist) -> None:
    """Inside a cell whose process group the run set up, code that calls
    ``init_process_group`` itself (a function written for TorchDistributor, say) gets that
    group instead of "trying to initialize the default process group twice"."""
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        if dist.is_initialized():
            return None
        return original(*args, **kwargs)

    init_process_group.__doc__ = original.__doc__
    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group


def start_process_group() -> bool:
    import torch
    import torch.distributed as dist

    from torchdist_magic.rank import runtime

    if dist.is_initialized():
        return False
    _init_once(dist)
    if runtime.uses_gpu() and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return True


def run_cell(job, ns: Optional[dict] = None):
    """Run a cell in ``ns`` (a warm rank's namespace, kept from cell to cell), else in a new one."""
    from torchdist_magic.core import values

    cell = job.cell
    ns = cell_namespace() if ns is None else ns
    for statement, origin in cell.imports:
        try:
            exec(compile(statement, f"<import from {origin}>", "exec"), ns)
        except Exception as exc:  # noqa: BLE001
            # with the import's own frame (``<import from In[1]>``, line 1): where it failed, which
            # a restart compares (``restarts``: the same import failing again is not retried)
            raise CellImportError(
                f"the notebook import `{statement}` ({origin}) failed on rank "
                f"{os.environ.get('RANK', '0')} ({socket.gethostname()}): {type(exc).__name__}: {exc}"
            ).with_traceback(exc.__traceback__) from None
    if cell.values:
        ns.update(values.loads_apart(cell.values, cell.buffers))
    padded = "\n" * cell.line_offset + cell.source
    # tracebacks show the cell as it was typed; the ranks run its translation (same line numbers)
    linecache.cache[cell.filename] = (len(padded), None, padded.splitlines(True), cell.filename)
    tree = ast.parse("\n" * cell.line_offset + (cell.python or cell.source), cell.filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    body = ast.Module(body=tree.body[:-1] if last else tree.body, type_ignores=[])
    ours = start_process_group() if cell.init_process_group else False
    import torch.distributed as dist

    from torchdist_magic.rank import runtime

    code = compile(body, cell.filename, "exec")
    runtime._code_started()
    exec(code, ns)
    value = eval(compile(ast.Expression(last.value), cell.filename, "eval"), ns) if last else None
    # Only on success: a failing rank exits with its group intact, so that its peers see the
    # connection drop after its own failure was recorded, never before (root-cause order).
    if dist.is_initialized():
        if ours:
            # a rank that finishes first must not tear down the group while a peer still
            # connects to it (gloo closes the mesh under the slower rank)
            dist.barrier()
        dist.destroy_process_group()
    return None if cell.silent else value


RUNNERS = {"function": _run_function, "script": _run_script}
