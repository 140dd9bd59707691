"""CPU results do not depend on the thread count (README,
"Reproducibility"; docs/design.md, "Rounding contract").

MKL's threaded GEMM splits its work by thread count and the split changes the
bits (on a 2-core AMD host a 100x100 Muon step differed between 1 and 4
threads; elsewhere beta != 0 GEMMs differed between 1 and 2). The CPU Muon
kernel therefore runs every GEMM as a fixed row panel on one thread. These
tests step the same data under several torch.set_num_threads values (more
threads than cores included: MKL splits by its thread count, not the cores)
and compare every written tensor bit for bit.
"""

import ctypes
import os

import pytest
import torch

import muon_ext
from support.helpers import assert_bit_equal, optimizer_tensors, run_python
from muon_ext import ops
from support.muon_helpers import stat_shape

THREADS = (1, 2, 3, 4)


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def across_threads(run):
    """run() under each thread count; returns {threads: list of tensors}."""
    out = {}
    for n in THREADS:
        torch.set_num_threads(n)
        out[n] = [t.clone() for t in run()]
    return out


def assert_same_across_threads(results, what):
    base = results[THREADS[0]]
    for n, tensors in results.items():
        for i, (a, b) in enumerate(zip(base, tensors)):
            assert_bit_equal(b, a, f"{what}: tensor {i} at {n} threads vs {THREADS[0]}")


def muon_bucket(shape, count, seed, master_mode):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(shape, generator=gen) * 0.05 for _ in range(count)]
    grads = [torch.randn(shape, generator=gen) for _ in range(count)]
    moms = [torch.randn(shape, generator=gen) * 0.1 for _ in range(count)]
    smbs = [torch.rand(stat_shape(shape), generator=gen) * 1e-2 for _ in range(count)]
    if master_mode == "remainder":
        params = [v.bfloat16() for v in values]
        masters = [torch.zeros(shape, dtype=torch.int16) for _ in range(count)]
        grads = [g.bfloat16() for g in grads]
    else:
        params, masters = values, []
    return params, grads, moms, smbs, masters


# Small and large, wide and tall; up to side^2 * length = 2^20 the small-matrix
# kernel (csrc/cpu/polar_small.h, sixteen matrices per vector: 19 of them fill
# one group and part of a second; muon_step runs the fused small-matrix step
# there), above it BLAS; sides >= 256 take the
# block-triangular path (csrc/common/polar_plan.h), sides > 128 are cut into
# several row panels.
SHAPES = [(1, 1), (8, 8), (40, 24), (64, 64), (100, 100), (96, 160), (300, 200), (256, 256), (256, 1024),
          (768, 256), (520, 600)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_muon_step_bits_do_not_depend_on_threads(shape):
    count = 19 if shape[0] * shape[1] <= 64 * 64 else 3 if shape[0] * shape[1] <= 300 * 200 else 1
    bucket = muon_bucket(shape, count, seed=shape[0] + shape[1], master_mode="fp32")

    def run():
        params, grads, moms, smbs, masters = [[t.clone() for t in ts] for ts in bucket]
        ops.muon_step(params, grads, moms, smbs, masters=masters, lr=0.02)
        return params + moms + smbs

    assert_same_across_threads(across_threads(run), f"muon_step {shape}")


@pytest.mark.parametrize("stack", [(300, 8, 8), (5000, 1, 1), (200, 3, 7)], ids=lambda s: "x".join(map(str, s)))
def test_fused_small_step_bits_do_not_depend_on_threads(stack):
    """One batch-view param of many small matrices: the fused small-matrix step
    hands runs of them to the threads (csrc/cpu/muon_small_step_cpu.cpp, small_step)."""
    params, grads, moms, smbs, masters = muon_bucket(stack, 1, seed=9, master_mode="remainder")

    def run():
        ps, ms, ss, rs = [[t.clone() for t in ts] for ts in (params, moms, smbs, masters)]
        ops.muon_step(ps, grads, ms, ss, masters=rs, lr=0.02)
        return ps + ms + ss + rs

    assert_same_across_threads(across_threads(run), f"fused small step {stack}")


@pytest.mark.parametrize("shape", [(100, 100), (300, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_muon_phases_bits_do_not_depend_on_threads(shape):
    params, grads, moms, smbs, masters = muon_bucket(shape, 2, seed=5, master_mode="remainder")

    def run():
        ps, ms, ss, rs = [[t.clone() for t in ts] for ts in (params, moms, smbs, masters)]
        updates = [torch.empty(shape) for _ in ps]
        ops.muon_momentum(grads, ms, updates)
        ops.muon_orthogonalize(updates, ss, beta2=0.95)
        ops.muon_apply(ps, updates, masters=rs, lr=0.02)
        return updates + ps + rs + ss

    assert_same_across_threads(across_threads(run), "muon phases")


def test_a_whole_optimizer_step_does_not_depend_on_threads():
    """MuonAdamW, BF16 + remainders (the default), Muon and AdamW groups, three steps."""
    shapes = [(256, 256), (768, 256), (256, 1024), (100, 100), (256,), (8192 + 13,)]

    def run():
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).bfloat16()) for s in shapes]
        opt = muon_ext.MuonAdamW([dict(params=params[:4], kind="muon"), dict(params=params[4:], kind="adamw")])
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
        tensors = optimizer_tensors(opt)
        return [tensors[k] for k in sorted(tensors)]

    assert_same_across_threads(across_threads(run), "MuonAdamW step")


_SUBPROCESS = """
import hashlib, os, torch
from muon_ext import ops
torch.set_num_threads(int(os.environ["MUON_EXT_TEST_THREADS"]))
gen = torch.Generator().manual_seed(0)
digest = hashlib.sha256()
for rows, cols in [(100, 100), (300, 200), (256, 1024)]:
    p = torch.randn(rows, cols, generator=gen) * 0.05
    g = torch.randn(rows, cols, generator=gen)
    m = torch.zeros(rows, cols)
    s = torch.zeros((rows, 1) if rows >= cols else (1, cols))
    ops.muon_step([p], [g], [m], [s], lr=0.02)
    for t in (p, m, s):
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
print(torch.get_num_threads(), digest.hexdigest())
"""


def test_fresh_processes_with_thread_env_agree():
    """Fresh processes, each set to its thread count before its first GEMM."""
    digests = set()
    for n in (1, 4):
        env = {**os.environ, "OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n), "MUON_EXT_TEST_THREADS": str(n)}
        proc = run_python(_SUBPROCESS, env=env)
        assert proc.returncode == 0, proc.stderr
        threads, digest = proc.stdout.split()
        assert int(threads) == n
        digests.add(digest)
    assert len(digests) == 1, "the same Muon steps gave different bits at 1 and 4 threads"


def test_kernel_restores_mkl_thread_count():
    """The kernel pins MKL to one thread per GEMM only while it runs."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    if not hasattr(lib, "MKL_Get_Max_Threads"):
        pytest.skip("torch is not linked with MKL")
    params, grads, moms, smbs, _ = muon_bucket((200, 200), 1, seed=1, master_mode="fp32")
    torch.set_num_threads(3)
    assert lib.MKL_Get_Max_Threads() == 3
    ops.muon_step(params, grads, moms, smbs, lr=0.02)
    assert lib.MKL_Get_Max_Threads() == 3
    torch.set_num_threads(2)
    assert lib.MKL_Get_Max_Threads() == 2


def test_a_fresh_threads_first_call_after_set_num_threads_gets_the_same_bits():
    """torch sets each thread's MKL thread count at its first parallel call
    once torch.set_num_threads was called; in a new caller's fresh worker
    threads that came after the kernel's one-thread setting and split that
    call's GEMMs (different bits in about one first call of a hundred)."""
    import threading

    x = torch.randn(2, 128, 512, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.set_num_threads(2)
        expected = x.clone()
        ops.muon_orthogonalize([expected], beta2=None, polar_dtype="float32")
        outs = []

        def first_call():
            out = x.clone()
            ops.muon_orthogonalize([out], beta2=None, polar_dtype="float32")
            outs.append(out)

        for _ in range(120):  # one at a time: each a new thread with a new team of workers
            t = threading.Thread(target=first_call)
            t.start()
            t.join(timeout=60)
        assert len(outs) == 120
        for out in outs:
            assert_bit_equal(out, expected, "first call in a new thread")
    finally:
        torch.set_num_threads(before)
