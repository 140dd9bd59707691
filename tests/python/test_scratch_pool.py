"""CPU scratch kept between calls (csrc/cpu/scratch_pool.h; docs/design.md,
"CPU kernels"): a reused block holds an earlier call's values, which must not
reach a result; one block per slot is kept and grown, never per call; a call
that finds its slot held by another thread allocates its own."""

import threading

import pytest
import torch

from muon_ext import _C, ops
from support.helpers import assert_bit_equal

METHODS = ["standard", "gram"]
DTYPES = ["float32", "bfloat16", "float16"]


def orthogonalize(x, polar_dtype, polar_method):
    out = x.clone()
    ops.muon_orthogonalize([out], beta2=None, polar_dtype=polar_dtype, polar_method=polar_method)
    return out


@pytest.mark.parametrize("polar_method", METHODS)
@pytest.mark.parametrize("polar_dtype", DTYPES)
def test_an_earlier_calls_scratch_does_not_reach_the_result(polar_dtype, polar_method):
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(2, 136, 520, generator=gen)
    # Another shape with other values (and infinities in its inputs' scale) leaves its traces in the block.
    large = torch.randn(1, 520, 1040, generator=gen) * 1e30
    first = orthogonalize(small, polar_dtype, polar_method)
    orthogonalize(large, polar_dtype, polar_method)
    assert_bit_equal(orthogonalize(small, polar_dtype, polar_method), first)


def test_the_block_is_kept_and_grown_not_allocated_per_call():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 256, 1024, generator=gen)
    orthogonalize(x, "float32", "gram")
    kept = _C.cpu_scratch_pool_bytes()
    # 256x1024 FP32 Gram: X and the next X (1 MiB each) and three 256x256 buffers at least.
    assert kept >= 2 * 256 * 1024 * 4 + 3 * 256 * 256 * 4
    orthogonalize(x, "float32", "gram")
    orthogonalize(x[:, :128], "float32", "standard")
    assert _C.cpu_scratch_pool_bytes() == kept
    # A wide matrix whose X alone outgrows the block (earlier tests may have grown it): one
    # iteration, cheap at 64 rows.
    cols = (kept // (64 * 4) // 64 + 1) * 64
    wide = torch.randn(1, 64, cols, generator=gen)
    ops.muon_orthogonalize([wide], beta2=None, ns_steps=1, polar_dtype="float32")
    grown = _C.cpu_scratch_pool_bytes()
    assert grown > kept and grown >= 2 * 64 * cols * 4


def test_concurrent_calls_from_two_threads_get_the_sequential_bits():
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(2, 128, 512, generator=gen) for _ in range(2)]
    expected = [orthogonalize(x, "float32", "standard") for x in inputs]
    results = [[None] * 4 for _ in inputs]
    errors = []

    def work(i):
        try:
            for r in range(4):
                results[i][r] = orthogonalize(inputs[i], "float32", "standard")
        except Exception as e:  # reported below: a thread's exception would not fail the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert not errors, errors
    for i, runs in enumerate(results):
        for out in runs:
            assert_bit_equal(out, expected[i])
