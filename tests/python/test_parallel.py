"""The CPU kernels run on torch's threads, and their bits do not depend on how
many (docs/design.md, "CPU kernels").

Compiled without torch's OpenMP flags, `at::parallel_for` takes ATen's serial
branch and every kernel runs on one thread, silently. Three checks catch that:
the `_C` probe (at::parallel_for as compiled into the extension), the CPU time
each OS thread of the process spends inside every pass on a large input, and
the bits of every pass at 1, 2 and 3 threads (the GEMMs of Polar-Express are
covered by test_reproducibility.py).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, List

import pytest
import torch

from support.helpers import assert_bit_equal
from muon_ext import _C, ops
from support.muon_helpers import stat_shape


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_for_runs_on_every_thread(threads):
    torch.set_num_threads(threads)
    assert _C.threads_used_by_parallel_for(256, 1) == threads, (
        "at::parallel_for in the extension does not use torch's threads: built without torch's OpenMP flags?")


def _thread_cpu_seconds() -> Dict[int, float]:
    """CPU time (user + system) of each OS thread of this process."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def _busy_threads(run: Callable[[], None], seconds: float = 0.6) -> List[float]:
    """Each thread's share of the CPU time `run` took, repeated for `seconds`, largest first."""
    run()  # warm up: the thread pool starts, workspaces are allocated
    before = _thread_cpu_seconds()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        run()
    after = _thread_cpu_seconds()
    used = [after[t] - before.get(t, 0.0) for t in after]
    total = sum(used)
    assert total > 0.2, f"too little CPU time measured ({total:.2f} s) to judge"
    return sorted((u / total for u in used), reverse=True)


N = 1 << 22  # elements per large tensor: ~20 work items of 16384 per thread, and more


def _adamw(mode):
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(N, generator=gen)
    masters = []
    if mode == "bf16_remainder":
        param = param.bfloat16()
        masters = [torch.zeros(N, dtype=torch.int16)]
    grad = torch.randn(N, generator=gen)
    state = [torch.zeros(N), torch.zeros(N), torch.zeros(())]
    return lambda: ops.adamw_step([param], [grad], [state[0]], [state[1]], [state[2]], masters=masters, lr=1e-4)


def _split_merge():
    master = torch.randn(N)
    param, remainder = ops.split_master(master)

    def run():
        ops.split_master(master)
        ops.merge_master(param, remainder)
    return run


SHAPE, COUNT = (128, 256), 64  # many matrices: the per-matrix NorMuon pass spreads over them


def _muon_tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (COUNT, *SHAPE)
    return dict(param=(torch.randn(shape, generator=gen) * 0.02).bfloat16(),
                master=torch.zeros(shape, dtype=torch.int16),
                grad=torch.randn(shape, generator=gen),
                momentum=torch.randn(shape, generator=gen) * 0.1,
                stat=torch.rand((COUNT, *stat_shape(SHAPE)), generator=gen),
                update=torch.randn(shape, generator=gen))


def _muon_momentum():
    t = _muon_tensors()
    return lambda: ops.muon_momentum([t["grad"]], [t["momentum"]], [t["update"]])


def _muon_apply():
    t = _muon_tensors()
    return lambda: ops.muon_apply([t["param"]], [t["update"]], masters=[t["master"]], lr=1e-3, weight_decay=0.1)


def _muon_normuon_only():
    # ns_steps=0: input scale and NorMuon statistics, no GEMM.
    t = _muon_tensors()
    return lambda: ops.muon_orthogonalize([t["update"]], [t["stat"]], beta2=0.95, ns_steps=0)


def _muon_step_no_gemm():
    t = _muon_tensors()
    return lambda: ops.muon_step([t["param"]], [t["grad"]], [t["momentum"]], [t["stat"]], masters=[t["master"]],
                                 lr=1e-3, ns_steps=0)


def _muon_step():
    t = _muon_tensors()
    return lambda: ops.muon_step([t["param"]], [t["grad"]], [t["momentum"]], [t["stat"]], masters=[t["master"]],
                                 lr=1e-3, ns_steps=2)


def _polar_express_small_matrices():
    # 4096 matrices of 16x16: the small-matrix kernel (csrc/cpu/polar_small.h),
    # groups of sixteen matrices handed to the threads.
    x = torch.randn(4096, 16, 16, generator=torch.Generator().manual_seed(4))
    return lambda: ops.muon_orthogonalize([x], beta2=None, ns_steps=2)


PASSES = {
    "adamw_fp32": lambda: _adamw("fp32"),
    "adamw_bf16_remainder": lambda: _adamw("bf16_remainder"),
    "split_and_merge": _split_merge,
    "muon_momentum": _muon_momentum,
    "muon_apply": _muon_apply,
    "muon_scale_and_normuon": _muon_normuon_only,
    "muon_step_passes": _muon_step_no_gemm,
    "muon_step_with_polar_express": _muon_step,
    "polar_express_small_matrices": _polar_express_small_matrices,
}


@pytest.mark.parametrize("name", list(PASSES))
def test_every_cpu_pass_spreads_over_two_threads(name):
    """With 2 threads, two OS threads each do a real share of the work."""
    torch.set_num_threads(2)
    shares = _busy_threads(PASSES[name]())
    assert len(shares) >= 2 and shares[1] > 0.2, (
        f"{name}: CPU time per thread {[round(s, 2) for s in shares[:4]]}: the pass runs on one thread")


def _state_after(name: str, threads: int) -> List[torch.Tensor]:
    torch.set_num_threads(threads)
    gen_tensors = {
        "adamw": lambda: _adamw_state(),
        "muon": lambda: _muon_tensors(seed=3),
    }
    if name.startswith("adamw"):
        s = gen_tensors["adamw"]()
        for _ in range(2):
            ops.adamw_step([s["param"]], [s["grad"]], [s["exp_avg"]], [s["exp_avg_sq"]], [s["step"]],
                           masters=[s["master"]], lr=1e-3)
        return list(s.values())
    if name == "split_and_merge":
        master = torch.randn(N, generator=torch.Generator().manual_seed(5))
        param, remainder = ops.split_master(master)
        return [param, remainder, ops.merge_master(param, remainder)]
    t = gen_tensors["muon"]()
    ops.muon_momentum([t["grad"]], [t["momentum"]], [t["update"]])
    ops.muon_orthogonalize([t["update"]], [t["stat"]], beta2=0.95, ns_steps=0)
    ops.muon_apply([t["param"]], [t["update"]], masters=[t["master"]], lr=1e-3, weight_decay=0.1)
    ops.muon_step([t["param"]], [t["grad"]], [t["momentum"]], [t["stat"]], masters=[t["master"]], lr=1e-3,
                  ns_steps=0)
    return list(t.values())


def _adamw_state():
    gen = torch.Generator().manual_seed(4)
    return dict(param=torch.randn(N + 13, generator=gen).bfloat16(), grad=torch.randn(N + 13, generator=gen),
                exp_avg=torch.zeros(N + 13), exp_avg_sq=torch.zeros(N + 13), step=torch.zeros(()),
                master=torch.zeros(N + 13, dtype=torch.int16))


@pytest.mark.parametrize("name", ["adamw", "split_and_merge", "muon_passes"])
def test_pass_bits_do_not_depend_on_the_thread_count(name):
    base = _state_after(name, 1)
    for threads in (2, 3):
        for i, (a, b) in enumerate(zip(base, _state_after(name, threads))):
            assert_bit_equal(b, a, f"{name}: tensor {i} at {threads} threads vs 1")
