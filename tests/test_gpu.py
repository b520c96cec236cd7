"""GPU runs: nccl process group, one device per rank.  Skipped without CUDA."""

import pytest

from torchdist_magic import Distributor


def cuda_count():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_cuda = pytest.mark.skipif(cuda_count() == 0, reason="needs a CUDA device")


def nccl_all_reduce():
    import os

    import torch
    import torch.distributed as dist

    from torchdist_magic import device, local_rank

    torch.cuda.set_device(local_rank())
    dist.init_process_group("nccl")
    t = torch.ones(1, device=device()) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    name = torch.cuda.get_device_name(device())
    dist.destroy_process_group()
    return t.item(), str(device()), name, os.environ["TORCHDIST_USE_GPU"]


@pytest.mark.gpu
@needs_cuda
def test_nccl_all_reduce_on_gpus():
    n = cuda_count()
    total, dev, name, flag = Distributor(n, use_gpu=True, show=None).run(nccl_all_reduce)
    assert total == n * (n + 1) / 2
    assert dev == "cuda:0" and flag == "1" and name


@pytest.mark.gpu
@needs_cuda
def test_gpu_cell_gets_nccl_group_and_device(ip):
    result = ip.run_cell(
        "%%torchdist --np 1 --gpu --quiet\nimport torch.distributed as dist\n(dist.get_backend(), str(device))"
    )
    assert result.result == ("nccl", "cuda:0")


@pytest.mark.skipif(cuda_count() > 0, reason="checks the error on a machine without CUDA")
def test_gpu_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="use_gpu/--gpu was asked for, but no CUDA device is visible on this machine"):
        Distributor(1, use_gpu=True, show=None).run(print)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_count() == 0 or cuda_count() > 8, reason="needs CUDA")
def test_more_ranks_than_gpus_is_a_clear_error():
    n = cuda_count()
    with pytest.raises(ValueError, match=f"{n + 1} ranks with use_gpu/--gpu need {n + 1} GPUs; this machine has {n}"):
        Distributor(n + 1, use_gpu=True, show=None).run(print)


def nccl_on_the_pool():
    import os

    import torch
    import torch.distributed as dist

    from torchdist_magic import device

    t = torch.ones(1, device=device())
    dist.all_reduce(t)  # the pool's nccl group, set up once
    return os.getpid(), dist.get_backend(), t.item(), torch.cuda.current_device()


@pytest.mark.gpu
@needs_cuda
def test_a_warm_pool_keeps_its_nccl_group_and_gpus():
    from torchdist_magic import shutdown_pools

    n = cuda_count()
    d = Distributor(n, use_gpu=True, show=None, warm=True, all_ranks=True)
    try:
        first, second = d.run(nccl_on_the_pool), d.run(nccl_on_the_pool)
    finally:
        shutdown_pools()
    assert first == second  # same processes, same group, same device
    assert [(backend, total, dev) for _, backend, total, dev in first] == [("nccl", float(n), r) for r in range(n)]


def allocate_on_the_gpu_and_wait():
    import time

    import torch

    from torchdist_magic import device

    held = torch.ones(64 << 20, device=device())  # 256 MiB
    time.sleep(5.0)  # samples at 2 s: the launcher's and the rank's own (torch's peak) arrive
    return float(held.sum().item())


@pytest.mark.gpu
@needs_cuda
def test_nvml_samples_a_device_s_memory_and_utilisation():
    from torchdist_magic.launch.gpu_metrics import GPU_KEYS, open_gpu_source

    source = open_gpu_source()
    assert source is not None, "nvidia-ml-py (the gpu extra) is not installed or NVML has no driver"
    try:
        sample = source.sample(["0"])
    finally:
        source.close()
    assert set(sample) == set(GPU_KEYS)
    assert 0 < sample["gpu_memory_used_bytes"] <= sample["gpu_memory_total_bytes"]
    assert 0 <= sample["gpu_util_percent"] <= 100


@pytest.mark.gpu
@needs_cuda
def test_a_gpu_run_has_each_rank_s_device_memory_and_torch_s_peak():
    run = Distributor(1, use_gpu=True, show=None).submit(allocate_on_the_gpu_and_wait)
    run.result(timeout=300)
    system = run.state.ranks[0].system
    assert system["gpu_memory_total_bytes"] >= system["gpu_memory_used_bytes"] > 256 << 20
    assert 0 <= system["gpu_util_percent"] <= 100
    assert system["torch_max_allocated_bytes"] >= 256 << 20


def cuda_value(mib, tensor=None):
    """Rank 0's value: a CUDA tensor of ``mib`` MiB (``tensor``, one the notebook sent, when
    given: where it arrived, and its sum)."""
    import torch

    from torchdist_magic import device, rank

    if tensor is not None:
        return str(tensor.device), float(tensor.double().sum())
    value = torch.arange(mib * 2**18, dtype=torch.float32, device=device())
    return value if rank() == 0 else None


@pytest.mark.gpu
@needs_cuda
def test_a_cuda_value_comes_back_whole_on_the_cpu():
    import torch

    value = Distributor(1, use_gpu=True, show=None).run(cuda_value, 256)
    assert value.device.type == "cpu" and value.dtype == torch.float32  # as torch.save with map_location="cpu"
    assert torch.equal(value, torch.arange(256 * 2**18, dtype=torch.float32))


@pytest.mark.gpu
@needs_cuda
def test_a_notebook_cuda_tensor_reaches_a_gpu_rank_on_its_device():
    import torch

    sent = torch.ones(64 * 2**18, device="cuda:0")
    where, total = Distributor(1, use_gpu=True, show=None).run(cuda_value, 0, sent)
    assert where == "cuda:0" and total == 64 * 2**18
