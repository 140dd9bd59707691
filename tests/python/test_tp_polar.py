"""muon_ext.distributed.tp_polar: Polar-Express over a matrix split by rows or
columns across a gloo group (an all_reduce of the Gram product per
iteration) equals the single-device FP32 orthogonalization of the whole matrix
to 2e-5 (FP32 rounding of different partitions), for wide, tall and square
matrices, on 2 spawned processes."""

import pytest
import torch

from support.dist_helpers import spawn
from muon_ext import ops
from muon_ext.distributed.tp_polar import polar_express_sharded

SHAPES = [(16, 48), (48, 16), (32, 32), (6, 10)]
TOLERANCE = 2e-5  # max |difference| of entries; entries of an orthogonal 48 x 16 matrix are ~0.2


def _whole(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _sharded_cases(rank: int, world: int) -> None:
    import torch.distributed as dist

    coefficients = ops.POLAR_EXPRESS_COEFFICIENTS
    for seed, (rows, cols) in enumerate(SHAPES):
        whole = _whole(rows, cols, seed)
        expected = whole.clone().unsqueeze(0)
        ops.muon_orthogonalize([expected], beta2=None, ns_steps=5, polar_dtype="float32")
        for dim in (0, 1):
            shard = whole.chunk(world, dim=dim)[rank].clone()  # a row chunk is already contiguous: a view
            sent = polar_express_sharded(shard, dist.group.WORLD, dim, coefficients, 5)
            want = expected[0].chunk(world, dim=dim)[rank]
            err = (shard - want).abs().max().item()
            assert err <= TOLERANCE, f"{rows}x{cols} split on dim {dim}: max error {err}"
            small = rows if dim == 1 else cols
            assert sent == 8 + 5 * small * small * 4, sent
    # ns_steps=0: the input scale only, by the whole matrix's norm
    whole = _whole(8, 8, 99)
    shard = whole.chunk(world, dim=1)[rank].clone()
    polar_express_sharded(shard, dist.group.WORLD, 1, coefficients, 0)
    scaled = whole * (1.0 / (whole.double().pow(2).sum().sqrt().float() * 1.02 + 1e-6))
    assert torch.allclose(shard, scaled.chunk(world, dim=1)[rank], rtol=1e-6, atol=0)


def test_sharded_polar_express_matches_the_whole_matrix(tmp_path):
    spawn(tmp_path, 2, _sharded_cases, timeout_s=120)


def test_bad_arguments_are_refused_before_any_collective():
    coefficients = ops.POLAR_EXPRESS_COEFFICIENTS
    with pytest.raises(ValueError, match="shard_dim"):
        polar_express_sharded(torch.zeros(2, 2), None, 2, coefficients, 5)
    with pytest.raises(TypeError, match="float32"):
        polar_express_sharded(torch.zeros(2, 2, dtype=torch.bfloat16), None, 0, coefficients, 5)
    with pytest.raises(ValueError, match="ns_steps"):
        polar_express_sharded(torch.zeros(2, 2), None, 0, coefficients, len(coefficients) + 1)
