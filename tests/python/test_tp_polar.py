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


# -- MuonAdamW's DTensor step with split_polar="gram" -----------------------------------------------------------

GRAM_TOLERANCE = 1e-5  # max |master difference| to one process after 3 steps at lr 0.02 (FP32 Gram products)


def _gram_cases(rank, world):
    """split_polar="gram" on DTensor params split by rows or columns (every rank
    orthogonalizes its own shard, no matrix is gathered): masters within
    GRAM_TOLERANCE of one process with FP32 Polar-Express, with and without
    NorMuon (whole-matrix statistics, also per row block), with row blocks
    (an interleaved QKV with per-block scales); replicated statistics stay
    identical on every rank; a GradScaler-skipped step changes nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muon_ext import MuonAdamW, row_blocks
    from support.dist_helpers import assert_same_on_every_rank

    mesh = init_device_mesh("cpu", (world,))
    qkv = row_blocks.interleaved(2, (8, 4, 4))  # 32 rows, one query group per rank on a row split
    settings = dict(kind="muon", lr=0.02, weight_decay=0.1, lr_scale="original", polar_dtype="float32")
    cases = [((32, 16), None, None), ((16, 40), None, None), ((32, 16), qkv, (1.0, 0.5, 2.0))]
    for (rows, cols), blocks, scales in cases:
        for beta2 in (None, 0.95):
            gen = torch.Generator().manual_seed(rows + cols)
            whole = torch.randn(rows, cols, generator=gen)
            grads = [torch.randn(rows, cols, generator=gen) for _ in range(3)]
            keys = dict(settings, beta2=beta2, row_blocks=blocks, row_block_scales=scales)
            ref = torch.nn.Parameter(whole.clone())
            ref_opt = MuonAdamW([dict(params=[ref], **keys)])
            for g in grads:
                ref.grad = g.clone()
                ref_opt.step()
            for placement in (Shard(0), Shard(1)):
                p = torch.nn.Parameter(distribute_tensor(whole.clone(), mesh, [placement], src_data_rank=None))
                opt = MuonAdamW([dict(params=[p], split_polar="gram", **keys)])
                for g in grads:
                    p.grad = distribute_tensor(g.clone(), mesh, [placement], src_data_rank=None)
                    opt.step()
                what = f"{rows}x{cols} {placement} blocks={blocks is not None} beta2={beta2}"
                err = (p.full_tensor() - ref.detach()).abs().max().item()
                assert err <= GRAM_TOLERANCE, f"{what}: {err}"
                assert opt._distributed.bytes_sent > 0, what
                stats = opt.state[p].get("second_momentum_buffer")
                if stats is not None:
                    want = ref_opt.state[ref]["second_momentum_buffer"]
                    assert (stats.full_tensor() - want).abs().max().item() <= 1e-4, what
                    if tuple(stats.placements) != (placement,):
                        assert_same_on_every_rank(stats.to_local(), what)
    # A GradScaler's found inf: nothing moves (masters, moments, statistics)
    p = torch.nn.Parameter(distribute_tensor(torch.randn(32, 16, generator=torch.Generator().manual_seed(5)), mesh,
                                             [Shard(1)], src_data_rank=None))
    opt = MuonAdamW([dict(params=[p], split_polar="gram", beta2=0.95, **settings)])
    p.grad = distribute_tensor(torch.ones(32, 16), mesh, [Shard(1)], src_data_rank=None)
    opt.step()
    before = {k: v.full_tensor().clone() for k, v in opt.state[p].items()}, p.full_tensor().clone()
    opt.grad_scale, opt.found_inf = torch.ones(()), torch.ones(())
    opt.step()
    assert torch.equal(p.full_tensor(), before[1])
    for k, v in opt.state[p].items():
        assert torch.equal(v.full_tensor(), before[0][k]), k


def test_gram_split_polar_in_the_dtensor_step_matches_one_process(tmp_path):
    spawn(tmp_path, 2, _gram_cases, timeout_s=180)


def test_bad_split_polar_is_refused():
    from muon_ext import MuonAdamW

    with pytest.raises(ValueError, match="split_polar"):
        MuonAdamW([dict(params=[torch.nn.Parameter(torch.randn(4, 4))], kind="muon", split_polar="owner")])


def test_split_polar_is_the_earlier_name_of_split_matrices():
    """Groups and checkpoints written with `split_polar` ("exchange" / "gram") load as `split_matrices`
    ("gather" / "in_place"); a value of neither name is refused, naming the key."""
    from muon_ext import MuonAdamW

    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = MuonAdamW([dict(params=[p], kind="muon", split_polar="gram")])
    assert opt.param_groups[0]["split_matrices"] == "in_place" and "split_polar" not in opt.param_groups[0]
    saved = opt.state_dict()
    saved["param_groups"][0].pop("split_matrices")
    saved["param_groups"][0]["split_polar"] = "exchange"
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["split_matrices"] == "gather" and "split_polar" not in opt.param_groups[0]
    with pytest.raises(ValueError, match="split_matrices must be one of"):
        MuonAdamW([dict(params=[torch.nn.Parameter(torch.randn(4, 4))], kind="muon", split_matrices="gram")])
    with pytest.raises(ValueError, match="polar_method='gram' with split_matrices='in_place'"):
        MuonAdamW([dict(params=[torch.nn.Parameter(torch.randn(4, 4))], kind="muon", split_matrices="in_place",
                        polar_method="gram")])
