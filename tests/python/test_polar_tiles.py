"""The native BF16 Polar-Express on oneDNN's micro-kernel, AMX tiles or
AVX-512 BF16 (csrc/cpu/bf16_tile_gemm.cpp; docs/design.md, "CPU kernels"): the
BF16 contract (FP32 accumulation, each GEMM output rounded to BF16 once), the
same bits for any thread count, batch or address, tall matrices run as their
transposes, and the at::addmm path it replaces as the fallback. Skipped where
the CPU runs no micro-kernel (`ops.cpu_bf16_tile_gemm()` is "")."""

import pytest
import torch

from muon_ext import ops
from support.helpers import assert_bit_equal, onednn_off

pytestmark = pytest.mark.skipif(not ops.cpu_bf16_tile_gemm(), reason="no AVX-512 BF16 / AMX-BF16 micro-kernel on this CPU")

# Sides multiples of 16 (the micro-kernel's): wide, tall, the symmetric tiles
# skipped (side >= 512 on AMX, >= 128 on AVX-512 BF16), a long side split into packed chunks (k = 4096), and
# one with a side that is not a multiple of 16 (the at::addmm fallback).
SHAPES = [(2, 64, 160), (2, 160, 64), (2, 256, 256), (1, 512, 640), (1, 640, 512), (1, 32, 4096), (2, 40, 72)]


@pytest.fixture
def tiles(monkeypatch):
    def set_tiles(on: bool):
        monkeypatch.setenv("MUON_EXT_CPU_TILE_GEMM", "1" if on else "0")
    return set_tiles


def orthogonalize(x, **kw):
    out = x.clone()
    ops.muon_orthogonalize([out], beta2=None, polar_dtype="bfloat16", **kw)
    return out


def svd_polar(x):
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tiles_are_as_accurate_as_the_addmm_path(shape, tiles):
    """Both paths round the same outputs to BF16 and differ only in the FP32
    summation order: their distance to the FP64 polar factor agrees within 10%
    (measured: within 1%), and they differ from each other by BF16 noise."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    tiles(True)
    ours = orthogonalize(x)
    tiles(False)
    addmm = orthogonalize(x)
    exact = svd_polar(x)
    e_tiles = (ours.double() - exact).norm() / exact.norm()
    e_addmm = (addmm.double() - exact).norm() / exact.norm()
    assert e_tiles <= 1.1 * e_addmm + 1e-3, (e_tiles.item(), e_addmm.item())
    torch.testing.assert_close(ours, addmm, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("shape", SHAPES[:6], ids=lambda s: "x".join(map(str, s)))
def test_tile_bits_do_not_depend_on_threads_batch_or_address(shape, tiles):
    tiles(True)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        base = orthogonalize(x)
        torch.set_num_threads(2)
        assert_bit_equal(orthogonalize(x), base, "2 threads vs 1")
        for j in range(shape[0]):  # each matrix alone, at an odd offset in a bigger buffer
            holder = torch.empty(x[j].numel() + 3)
            alone = holder[3:].view(x[j].shape)
            alone.copy_(x[j])
            ops.muon_orthogonalize([alone], beta2=None, polar_dtype="bfloat16")
            assert_bit_equal(alone, base[j], f"matrix {j} alone, unaligned")
    finally:
        torch.set_num_threads(before)


def test_tiles_round_every_gemm_output_to_bf16(tiles):
    """One iteration with (a, b, c) = (1, 0, 0) is X <- X (exactly, in BF16):
    the output is X rounded to BF16 once, on both paths."""
    tiles(True)
    x = torch.randn(1, 64, 160, generator=torch.Generator().manual_seed(3))
    x = x / (x.norm() * 1.02 + 1e-6)  # the input scale is then ~1 (a power of two away from exact)
    out = orthogonalize(x, ns_steps=1, ns_coefficients=[(1.0, 0.0, 0.0)])
    torch.testing.assert_close(out, out.bfloat16().float(), rtol=0, atol=0)


def test_the_setting_is_read_at_every_call(tiles):
    """MUON_EXT_CPU_TILE_GEMM=0 takes the at::addmm path (other bits), =1 the tiles again."""
    x = torch.randn(1, 128, 256, generator=torch.Generator().manual_seed(4))
    tiles(True)
    a = orthogonalize(x)
    tiles(False)
    b = orthogonalize(x)
    tiles(True)
    assert_bit_equal(orthogonalize(x), a, "tiles again")
    assert not torch.equal(a, b), "the setting changed nothing: are both paths the tiles?"


def test_the_instruction_set_is_named_and_oneDNN_switched_off_takes_addmm(tiles):
    """cpu_bf16_tile_gemm() names the kernel's instruction set (AMX and AVX-512 BF16 sum in different
    orders: the distributed agreement compares it); with torch's oneDNN switched off, cpublas would refuse
    the pair layout, so the path is at::addmm then ("", and a result as close as the tiles-off one)."""
    tiles(True)
    has_amx = torch.cpu._is_amx_tile_supported()
    assert ops.cpu_bf16_tile_gemm() == ("amx" if has_amx else "avx512_bf16")
    x = torch.randn(1, 128, 256, generator=torch.Generator().manual_seed(5))
    with onednn_off():
        assert ops.cpu_bf16_tile_gemm() == ""
        off = orthogonalize(x)
    tiles(False)
    assert ops.cpu_bf16_tile_gemm() == ""
    torch.testing.assert_close(off, orthogonalize(x), atol=0.05, rtol=0.05)
