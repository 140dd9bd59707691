"""Spawned gloo worlds for the distributed tests: a collective timeout of
60 s and a join deadline, so that a hang fails the test instead of stalling CI."""

from __future__ import annotations

import datetime
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60


def _worker(rank: int, world: int, store: str, backend: str, fn, args) -> None:
    torch.set_num_threads(1)  # 2-core CI: W processes share the cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # Passed: leave without interpreter finalization. A CI run once saw both
    # ranks of a passing job abort at exit ("terminate called without an active
    # exception", SIGABRT) while torch tore down its distributed threads; the
    # exit code then failed a test whose checks had all passed. PyTorch knows a
    # form of it (pytorch/pytorch#179291, not merged: Gloo worker threads still
    # holding tensors when the interpreter is torn down). A failure still
    # raises above, so torch.multiprocessing records its traceback.
    # os._exit also skips multiprocessing's exit handler, which ends the
    # processes a rank started (Megatron's checkpoint workers): ended here,
    # or they outlive the test as orphans (about 0.6 GB each).
    for child in mp.active_children():
        child.terminate()
        child.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(tmp_path, world: int, fn, *args, timeout_s: float = 300.0, backend: str = "gloo") -> None:
    """Runs fn(rank, world, *args) on `world` spawned processes in one process
    group (gloo on CPUs; nccl: one GPU per rank); fails if any raises or the
    job outlives `timeout_s`."""
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not dist.is_available() or not available:
        pytest.skip(f"torch.distributed with {backend} is unavailable")
    store = tmp_path / f"store_{world}_{time.monotonic_ns()}"
    ctx = mp.start_processes(_worker, args=(world, str(store), backend, fn, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"distributed job {fn.__name__} at W={world} hung for {timeout_s} s")


def bits(t: torch.Tensor) -> torch.Tensor:
    kind = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.detach().contiguous().view(kind)


def assert_same_on_every_rank(t: torch.Tensor, what: str) -> None:
    """Bit equality of a plain tensor across the default group."""
    mine = bits(t).to(torch.int32).reshape(-1)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    for r, other in enumerate(gathered):
        assert torch.equal(other, mine), f"{what}: rank {r} differs from rank {dist.get_rank()}"

