"""The split-matrix ops (torch.ops.muon_ext.sharded_*; docs/design.md, "Split matrices orthogonalized in
place") on the CPU, against muon_ext.reference: a matrix cut into shards in one process, each collective
replaced by a plain sum of the shards' outputs. Polar-Express on the shards equals the whole matrix's
iterations to FP32 rounding of other partitions (float32), and rounds every iterate to the 16-bit type
(bfloat16 / float16); NorMuon on the shards equals the whole matrix's, in each of its three layouts."""

import pytest
import torch

from muon_ext import ops, reference

COEFFICIENTS = ops.POLAR_EXPRESS_COEFFICIENTS
SHAPES = [(16, 48), (48, 16), (24, 24), (6, 10)]
FP32_TOLERANCE = 2e-5  # max |difference| of entries (~0.1-0.3 for these orthogonal matrices)


def _matrices(rows, cols, n=2, seed=0):
    return torch.randn(n, rows, cols, generator=torch.Generator().manual_seed(seed + rows * cols))


def _sharded_polar(whole: torch.Tensor, shard_dim: int, world: int, polar_dtype: str, steps: int = 5):
    """The ops on `world` shards of each matrix of `whole` [n, rows, cols], sums standing for all_reduces."""
    shards = [s.clone() for s in whole.chunk(world, dim=1 + shard_dim)]
    sums = [torch.empty(whole.shape[0], dtype=torch.float64) for _ in shards]
    for x, s in zip(shards, sums):
        ops.sharded_polar_norms(x, s)
    total = torch.stack(sums).sum(0)
    for x in shards:
        ops.sharded_polar_scale(x, total, polar_dtype=polar_dtype)
    side = whole.shape[1] if shard_dim == 1 else whole.shape[2]
    for step in range(steps):
        grams = [torch.empty(whole.shape[0] * side * side) for _ in shards]
        for x, g in zip(shards, grams):
            ops.sharded_polar_gram(x, g, shard_dim=shard_dim, polar_dtype=polar_dtype)
        gram = torch.stack(grams).sum(0)
        for x in shards:
            ops.sharded_polar_iterate(x, gram, COEFFICIENTS[step], shard_dim=shard_dim, polar_dtype=polar_dtype)
    return torch.cat(shards, dim=1 + shard_dim)


def _reference_polar(whole: torch.Tensor, **rounding) -> torch.Tensor:
    norms = whole.double().pow(2).sum(dim=(1, 2)).float().sqrt().view(-1, 1, 1)
    return reference.polar_express(whole * (1.0 / (norms * 1.02 + 1e-6)), COEFFICIENTS, **rounding)


@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("shard_dim", [0, 1])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_float32_shards_equal_the_whole_matrix(rows, cols, shard_dim, world):
    whole = _matrices(rows, cols)
    got = _sharded_polar(whole, shard_dim, world, "float32")
    err = (got - _reference_polar(whole)).abs().max().item()
    assert err <= FP32_TOLERANCE, f"{rows}x{cols} shard_dim={shard_dim} world={world}: {err}"


@pytest.mark.parametrize("polar_dtype, rounding, dtype", [("bfloat16", dict(bf16=True), torch.bfloat16),
                                                          ("float16", dict(fp16=True), torch.float16)])
@pytest.mark.parametrize("shard_dim", [0, 1])
def test_sixteen_bit_shards_round_every_iterate(polar_dtype, rounding, dtype, shard_dim):
    """One shard in the reference's orientation is the reference's 16-bit iteration bit for bit (the rounding
    of A, B and X at each product); two shards give values of the 16-bit type, within the 16-bit rounding
    noise of other summation orders of it."""
    whole = _matrices(32, 48, seed=3)  # wide: the reference iterates with X X^T, the column-split form
    want = _reference_polar(whole, **rounding)
    if shard_dim == 1:
        assert torch.equal(_sharded_polar(whole, 1, 1, polar_dtype), want)
    got = _sharded_polar(whole, shard_dim, 2, polar_dtype)
    assert torch.equal(got, got.to(dtype).float())
    assert not torch.equal(got, _sharded_polar(whole, shard_dim, 2, "float32"))
    assert (got - want).abs().max().item() <= 0.05


def _reference_normuon(x: torch.Tensor, stats: torch.Tensor, beta2: float):
    x, stats = x.clone(), stats.clone()
    multipliers = reference._normuon_multipliers(x, stats, beta2)
    return x * multipliers, stats


@pytest.mark.parametrize("rows, cols", [(24, 8), (8, 24), (16, 16)])
@pytest.mark.parametrize("shard_dim", [0, 1])
@pytest.mark.parametrize("stats_local", [False, True])
def test_normuon_on_shards_equals_the_whole_matrix(rows, cols, shard_dim, stats_local):
    world, beta2 = 2, 0.9
    gen = torch.Generator().manual_seed(rows + 7 * cols)
    whole = torch.randn(rows, cols, generator=gen)
    per_row = rows >= cols
    stats_shape = (rows, 1) if per_row else (1, cols)
    start = torch.rand(stats_shape, generator=gen)
    want_x, want_stats = _reference_normuon(whole, start, beta2)
    stat_dim = 0 if per_row else 1
    follows = stat_dim == shard_dim  # the statistics follow the split: kept whole or locally
    if stats_local and not follows:
        pytest.skip("statistics kept locally only where they follow the split")
    shards = [s.clone() for s in whole.chunk(world, dim=shard_dim)]
    positions = torch.arange(whole.shape[shard_dim]).chunk(world)
    if stats_local:
        stats = [start.view(-1)[held].clone().view((-1, 1) if per_row else (1, -1)) for held in positions]
    else:
        stats = [start.clone() for _ in shards]
    payloads = [torch.empty(ops.sharded_normuon_payload_numel(x, rows, cols, shard_dim, stats_local),
                            dtype=torch.float64) for x in shards]
    settings = [dict(rows=rows, cols=cols, shard_dim=shard_dim, held=held, beta2=beta2, stats_local=stats_local)
                for held in positions]
    for x, s, payload, kw in zip(shards, stats, payloads, settings):
        ops.sharded_normuon_partial(x, s, payload, **kw)
    total = torch.stack(payloads).sum(0)  # every shard's payload has the same length: the all_reduce
    for x, s, kw in zip(shards, stats, settings):
        ops.sharded_normuon_finish(x, s, total, **kw)
    got_x = torch.cat(shards, dim=shard_dim)
    assert torch.allclose(got_x, want_x, rtol=2e-6, atol=1e-7), (got_x - want_x).abs().max()
    got_stats = torch.cat([s.view(-1) for s in stats]) if stats_local else stats[0].view(-1)
    assert torch.allclose(got_stats, want_stats.view(-1), rtol=1e-6, atol=0)
    if not stats_local:
        assert all(torch.equal(s, stats[0]) for s in stats)  # whole statistics: the same on every shard


def test_bad_arguments_name_the_problem():
    x = torch.zeros(1, 4, 6)
    with pytest.raises(ValueError, match="shard_dim"):
        ops.sharded_polar_gram(x, torch.empty(16), shard_dim=2, polar_dtype="float32")
    with pytest.raises(ValueError, match="polar_dtype"):
        ops.sharded_polar_scale(x, torch.zeros(1, dtype=torch.float64), polar_dtype="int8")
    with pytest.raises(TypeError, match="float32"):
        ops.sharded_polar_norms(x.bfloat16(), torch.empty(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="gram"):
        ops.sharded_polar_iterate(x, torch.empty(3), COEFFICIENTS[0], shard_dim=1, polar_dtype="float32")


def _op(name):
    return getattr(torch.ops.muon_ext, name).default


def _opcheck_cases():
    x = _matrices(4, 6, n=2)
    yield "sharded_polar_norms", (x, torch.empty(2, dtype=torch.float64)), {}
    yield "sharded_polar_scale", (x.clone(), torch.ones(2, dtype=torch.float64)), dict(polar_dtype="bfloat16")
    yield "sharded_polar_gram", (x, torch.empty(32)), dict(shard_dim=1, polar_dtype="float32")
    yield "sharded_polar_iterate", (x.clone(), torch.randn(32)), dict(a=3.0, b=-2.0, c=0.5, shard_dim=1,
                                                                      polar_dtype="float16")
    m = torch.randn(6, 4)
    kw = dict(rows=6, cols=4, shard_dim=1, held=None, beta2=0.9, stats_local=False)
    yield "sharded_normuon_partial", (m, torch.ones(6, 1), torch.empty(6, dtype=torch.float64)), kw
    yield "sharded_normuon_finish", (m.clone(), torch.ones(6, 1), torch.rand(6, dtype=torch.float64)), kw


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case):
    """Schemas (writes declared), fake kernels and dispatch, by torch's own checker."""
    name, args, kwargs = case
    torch.library.opcheck(_op(name), args, kwargs)
