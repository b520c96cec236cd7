"""Local backend: N worker processes on this machine (the embedded default: no Spark).

Its launchers are threads of the driver (``launch.launcher.start_rank``, the launcher every
backend's ranks run under): they need no channel of their own, and each rank writes its value
into the driver's value directory, where the driver maps it."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Collection, List, Optional, Set

from ..core.names import RESULT_FILE
from ..core.options import LaunchOptions
from ..core.procs import process_exited
from ..core.rankenv import place_ranks
from ..core.timing import CLOSE_GRACE
from ..core.values import map_value, value_directory
from ..launch.gpu_metrics import GpuSource
from ..launch.launcher import RankProcess, open_gpus, reserve_port, start_rank, stop_all, write_job_file
from .base import Backend, BackendRun, LaunchContext, LaunchPlan
from .frames import PreparedData, prepare_pandas


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class LocalProcessBackend(Backend):
    name = "local"

    def describe(self) -> str:
        return f"local processes on {socket.gethostname()}"

    def ranks_share_machine(self) -> bool:
        return True

    def prepare_data(self, data, num_processes: int, columns) -> PreparedData:
        return prepare_pandas(data, num_processes, columns)

    def check(self, options: LaunchOptions) -> LaunchPlan:
        if options.use_gpu:
            gpus = visible_gpu_count()
            if gpus == 0:
                raise ValueError("use_gpu/--gpu was asked for, but no CUDA device is visible on this machine")
            if options.num_processes > gpus:
                raise ValueError(
                    f"{options.num_processes} ranks with use_gpu/--gpu need {options.num_processes} GPUs; "
                    f"this machine has {gpus}"
                )
        return LaunchPlan(options.num_processes, tls=self.channel_tls(options))

    def start(self, ctx: LaunchContext) -> "LocalRun":
        run = LocalRun(
            tempfile.mkdtemp(prefix=f"torchdist-{ctx.spec.run_id}-"),
            value_directory(f"torchdist-{ctx.spec.run_id}-values-"),
        )
        try:
            run.launch(ctx)
        except BaseException:
            run.close()
            raise
        return run


class LocalRun(BackendRun):
    def __init__(self, workdir: str, value_dir: str):
        self.workdir = workdir
        #: where the ranks write their values (shared memory where there is some)
        self.value_dir = value_dir
        self.procs: List[RankProcess] = []
        self._port: Optional[socket.socket] = None
        #: NVML, for the ranks' GPU metrics (a run with GPUs and system metrics, where NVML is there)
        self._gpu_source: Optional[GpuSource] = None

    def launch(self, ctx: LaunchContext) -> None:
        job_file = os.path.join(self.workdir, "job.pkl")
        write_job_file(job_file, ctx.job_bytes)
        self._port = reserve_port("127.0.0.1")
        n = ctx.spec.num_processes
        host = socket.gethostname()
        self._gpu_source = open_gpus(ctx.spec)
        for place in place_ranks([host] * n, "127.0.0.1", self._port.getsockname()[1]):
            # the launcher is a thread of the driver: if the driver dies, the orphaned ranks
            # remove the run's files themselves
            self.procs.append(
                start_rank(
                    ctx.spec,
                    place,
                    job_file,
                    os.path.join(self.workdir, f"rank-{place.rank}"),
                    ctx.emit,
                    value_file=self._value_file(place.rank),
                    cleanup=[self.workdir, self.value_dir],
                    gpu_source=self._gpu_source,
                )
            )

    def stop(self, grace: float) -> None:
        stop_all(self.procs, grace)

    def stop_ranks(self, ranks: Collection[int], grace: float) -> Set[int]:
        procs = [p for p in self.procs if p.rank in ranks]
        stop_all(procs, grace)
        return {p.rank for p in procs}

    def dump_stacks(self) -> None:
        for p in self.procs:
            if p.alive():
                p.dump_stacks()

    def _value_file(self, rank: int) -> str:
        return os.path.join(self.value_dir, f"rank-{rank}.value")

    def result(self, rank: int):
        shared = map_value(self._value_file(rank), self.value_dir)
        folder = os.path.join(self.workdir, f"rank-{rank}")
        return (
            shared
            if shared is not None
            else map_value(  # shared memory was full
                os.path.join(folder, RESULT_FILE), folder
            )
        )

    def ranks_alive(self) -> bool:
        return bool(self.procs) and all(_running(p) for p in self.procs)

    def close(self) -> None:
        stop_all(self.procs, grace=CLOSE_GRACE)
        if self._port is not None:
            self._port.close()
            self._port = None
        if self._gpu_source is not None:
            self._gpu_source.close()
            self._gpu_source = None
        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.rmtree(self.value_dir, ignore_errors=True)


def _running(rank: RankProcess) -> bool:
    """Whether the rank's process has not exited.  ``Popen.poll`` answers "running" while the
    launcher's thread waits for the process, so the system is asked: a zombie has exited."""
    return rank.returncode is None and not process_exited(rank.proc.pid)
