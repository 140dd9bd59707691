"""The Muon group setting row_blocks (muon_ext.row_blocks): each param's row
blocks, contiguous or by row index (an interleaved fused QKV), are
orthogonalized as separate matrices, each with its own lr scale, bit-equal to
an optimizer whose params are the blocks themselves: in the resident runner
and the staged (offload) runner, for FP32 params, BF16 params with int16
remainders and with FP32 masters, with and without NorMuon (per-block
statistics), through a checkpoint; on DTensor params split by rows or
columns or replicated over 2 gloo processes (NorMuon statistics replicated),
bit-equal to one process. Bad settings are
refused before any write."""

import pytest
import torch

from muon_ext import MuonAdamW, row_blocks
from support.dist_helpers import spawn

ROWS, COLS = 32, 12
SIZES = (16, 8, 4, 4)  # factors sqrt(16/12) and 1; NorMuon statistics [16, 1], [8, 1] and [1, 12]
INDEX_BLOCKS = [list(range(0, 32, 2)), [1, 5, 9, 13, 17, 21, 25, 29], [3, 7, 11, 15], [19, 23, 27, 31]]
QKV = row_blocks.interleaved(4, (4, 2, 2))  # 4 query groups of 4 q, 2 k and 2 v rows
SETTINGS = dict(kind="muon", lr=0.02, weight_decay=0.1, lr_scale="original")


def _index_lists(spec):
    """The row indices of each block of `spec` (sizes or index blocks)."""
    if isinstance(spec[0], int):
        starts = [sum(spec[:k]) for k in range(len(spec))]
        return [list(range(s, s + n)) for s, n in zip(starts, spec)]
    return spec


def _grads(steps):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, COLS, generator=gen) for _ in range(steps)]


def _whole():
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))


def _run(spec, dtype, beta2, options, steps=3, split=False, checkpoint_at=None, scales=None):
    """(param, FP32 master) after `steps` steps: one param with row_blocks=`spec`
    (and row_block_scales=`scales`), or (`split`) the blocks as separate params
    (each in a group with lr * scale and weight_decay / scale), reassembled."""
    settings = dict(SETTINGS, beta2=beta2)
    index = [torch.tensor(rows) for rows in _index_lists(spec)]
    if split:
        params = [torch.nn.Parameter(_whole()[rows].to(dtype)) for rows in index]
        groups = [dict(params=params, **settings)] if scales is None else [
            dict(settings, params=[p], lr=settings["lr"] * s, weight_decay=settings["weight_decay"] / s)
            for p, s in zip(params, scales)]
    else:
        params = [torch.nn.Parameter(_whole().to(dtype))]
        groups = [dict(params=params, row_blocks=spec, row_block_scales=scales, **settings)]
    opt = MuonAdamW(groups, **options)
    for step, g in enumerate(_grads(steps)):
        if checkpoint_at == step:
            saved = opt.state_dict()
            opt = MuonAdamW(groups, **options)
            opt.load_state_dict(saved)
        if split:
            for p, rows in zip(params, index):
                p.grad = g[rows].to(dtype)
        else:
            params[0].grad = g.to(dtype)
        opt.step()
    masters = [opt.get_full_parameter_master(p) for p in params]
    if not split:
        return params[0].detach(), masters[0]
    param, master = torch.empty(ROWS, COLS, dtype=dtype), torch.empty(ROWS, COLS)
    for p, m, rows in zip(params, masters, index):
        param[rows], master[rows] = p.detach(), m
    return param, master


RUNNERS = {
    "fp32": (torch.float32, {}),
    "bf16_remainder": (torch.bfloat16, {}),
    "bf16_fp32_master": (torch.bfloat16, dict(store_param_remainders=False)),
    "offload_bf16": (torch.bfloat16, dict(offload="cpu")),
}


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("spec", [SIZES, INDEX_BLOCKS, QKV], ids=["sizes", "index", "qkv"])
@pytest.mark.parametrize("beta2", [None, 0.95], ids=["muon", "normuon"])
def test_row_blocks_equal_the_blocks_as_separate_params(runner, spec, beta2):
    dtype, options = RUNNERS[runner]
    param, master = _run(spec, dtype, beta2, options)
    ref_param, ref_master = _run(spec, dtype, beta2, options, split=True)
    assert torch.equal(param, ref_param) and torch.equal(master, ref_master)


SCALES = (2.0, 1.0, 0.5, 0.75)


@pytest.mark.parametrize("runner", ["bf16_remainder", "offload_bf16"])
def test_row_block_scales_scale_each_blocks_update_and_keep_its_decay(runner):
    dtype, options = RUNNERS[runner]
    got = _run(INDEX_BLOCKS, dtype, 0.95, options, scales=SCALES)
    want = _run(INDEX_BLOCKS, dtype, 0.95, options, split=True, scales=SCALES)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[1], _run(INDEX_BLOCKS, dtype, 0.95, options)[1])


def test_one_block_is_the_plain_step_and_blocks_change_it():
    whole_param, whole_master = _run((ROWS,), torch.bfloat16, 0.95, {})
    plain = torch.nn.Parameter(_whole().to(torch.bfloat16))
    opt = MuonAdamW([dict(params=[plain], beta2=0.95, **SETTINGS)])
    for g in _grads(3):
        plain.grad = g.to(torch.bfloat16)
        opt.step()
    assert torch.equal(whole_param, plain.detach())
    assert torch.equal(whole_master, opt.get_full_parameter_master(plain))
    assert not torch.equal(_run(SIZES, torch.bfloat16, 0.95, {})[0], whole_param)


@pytest.mark.parametrize("spec", [SIZES, QKV], ids=["sizes", "qkv"])
def test_normuon_block_statistics_survive_a_checkpoint(spec):
    resumed = _run(spec, torch.bfloat16, 0.95, {}, checkpoint_at=2)
    straight = _run(spec, torch.bfloat16, 0.95, {})
    assert torch.equal(resumed[0], straight[0]) and torch.equal(resumed[1], straight[1])
    p = torch.nn.Parameter(_whole())
    opt = MuonAdamW([dict(params=[p], row_blocks=spec, beta2=0.95, **SETTINGS)])
    assert tuple(opt.state[p]["second_momentum_buffer"].shape) == (
        row_blocks.stats_numel(row_blocks.parse(spec, ROWS), COLS), 1)


def test_flattened_params_are_cut_by_their_matrix_rows():
    """matrix_view="flatten": blocks of the [rows, prod(rest)] matrix, equal to the 2-D param's."""
    flat = torch.nn.Parameter(_whole().view(ROWS, 3, 4).clone())
    two_d = torch.nn.Parameter(_whole())
    opt = MuonAdamW([dict(params=[flat], row_blocks=QKV, matrix_view="flatten", beta2=None, **SETTINGS),
                     dict(params=[two_d], row_blocks=QKV, beta2=None, **SETTINGS)])
    for g in _grads(2):
        flat.grad, two_d.grad = g.view(ROWS, 3, 4).clone(), g
        opt.step()
    assert torch.equal(flat.detach().view(ROWS, COLS), two_d.detach())


def test_interleaved_builds_megatrons_qkv_layout():
    assert row_blocks.interleaved(2, (2, 1, 1)) == [[0, 1, 4, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="part_sizes"):
        row_blocks.interleaved(2, (2, 0))


@pytest.mark.parametrize("keys, view, match", [
    (dict(row_blocks=(16, 8)), "error", "sum to 24 rows"),
    (dict(row_blocks=(16, 0, 16)), "error", "positive ints"),
    (dict(row_blocks=()), "error", "non-empty"),
    (dict(row_blocks=[[0, 1], [1, 2]]), "error", "exactly once"),
    (dict(row_blocks=[[0, 1], []]), "error", "non-empty list"),
    (dict(row_blocks=(32,)), "batch", "batch of matrices"),
    (dict(row_blocks=(16, 16), row_block_scales=(1.0,)), "error", "row_block_scales must be"),
    (dict(row_blocks=(16, 16), row_block_scales=(1.0, -1.0)), "error", "row_block_scales must be"),
    (dict(row_block_scales=(1.0,)), "error", "without row_blocks"),
])
def test_bad_row_blocks_are_refused(keys, view, match):
    shape = (32, 24) if view == "error" else (2, 32, 24)
    p = torch.nn.Parameter(torch.randn(shape))
    with pytest.raises(ValueError, match=match):
        MuonAdamW([dict(params=[p], kind="muon", matrix_view=view, **keys)])
    opt = MuonAdamW([dict(params=[p], kind="muon", matrix_view=view, beta2=None)])
    opt.param_groups[0].update(keys)
    p.grad = torch.randn(shape)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p, before)


def test_changed_blocks_with_normuon_statistics_are_refused_before_writing():
    p = torch.nn.Parameter(_whole())
    opt = MuonAdamW([dict(params=[p], row_blocks=SIZES, beta2=0.95, **SETTINGS)])
    p.grad = _grads(1)[0]
    opt.step()
    opt.param_groups[0]["row_blocks"] = (16, 16)  # other blocks, other statistics
    before = p.detach().clone()
    with pytest.raises(ValueError, match="second_momentum_buffer"):
        opt.step()
    assert torch.equal(p, before)


def _two_groups(offload, spec=(8, 8, 8, 8), beta2=0.95):
    """An optimizer stepping a plain Muon group first, then a row-blocked one (FP32 masters resident and staged
    alike), after one step."""
    torch.manual_seed(0)
    a, p = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(_whole())
    opt = MuonAdamW([dict(params=[a], kind="muon"), dict(params=[p], row_blocks=spec, beta2=beta2, **SETTINGS)],
                    offload=offload, store_param_remainders=False)
    a.grad, p.grad = torch.randn(8, 8), _grads(1)[0]
    opt.step()
    return opt, a, p


@pytest.mark.parametrize("new_blocks", [None, (16, 16), (8, 8, 8, 8)])
def test_row_blocks_edit_is_refused_or_honoured_alike_resident_and_staged(new_blocks):
    """Statistics laid out for other blocks: refused before any group is written, in the same words, resident and
    staged (before, the staged step raised inside the kernel after stepping the other group, or read 4-block
    statistics as 2-block ones); the same layout ((8, 8, 8, 8) again) steps, to the same bits."""
    from support.optimizer_snapshot import snapshot

    results = []
    for offload in ("none", "cpu"):
        opt, a, p = _two_groups(offload)
        opt.param_groups[1]["row_blocks"] = new_blocks
        a.grad, p.grad = torch.randn(8, 8), _grads(2)[1]
        before = snapshot(opt)
        try:
            opt.step()
            results.append(("stepped", a.detach().clone(), p.detach().clone()))
        except ValueError as exc:
            assert snapshot(opt) == before
            results.append((str(exc), None, None))
    (resident, ra, rp), (staged, sa, sp) = results
    assert resident == staged
    if new_blocks == (8, 8, 8, 8):
        assert resident == "stepped" and torch.equal(ra, sa) and torch.equal(rp, sp)
    else:
        assert "laid out for other row blocks" in resident


def test_normuon_switched_on_after_a_row_blocks_edit_steps_alike_resident_and_staged():
    """NorMuon off, row_blocks edited, NorMuon on: the resident path makes the statistics in the new layout; the
    staged path moves the param's state to a slab laid out for it (its old region was never used): same bits."""
    out = []
    for offload in ("none", "cpu"):
        opt, a, p = _two_groups(offload, beta2=None)
        opt.param_groups[1].update(row_blocks=(16, 16), beta2=0.95)
        for g in _grads(3)[1:]:
            a.grad, p.grad = torch.ones(8, 8), g
            opt.step()
        out.append((p.detach().clone(), opt.state[p]["second_momentum_buffer"].clone(),
                    opt.get_full_parameter_master(p)))
    assert out[0][1].shape == (32, 1)  # two [16, 1]; the slab region was laid out for four [1, 12]
    for resident, staged in zip(*out):
        assert torch.equal(resident, staged)


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_checkpoint_with_other_row_blocks_is_refused_with_groups_unchanged(offload):
    """A checkpoint whose row_blocks need another statistics layout than this optimizer holds is refused before
    the groups are replaced (before: a bare RuntimeError after the group took the checkpoint's row_blocks, and
    every later step raised); the optimizer keeps stepping. Into an optimizer without statistics (NorMuon off)
    it loads, resident and staged alike, and adopts the checkpoint's row_blocks."""
    from support.optimizer_snapshot import snapshot

    saved, _, _ = _two_groups("none", spec=(16, 16))
    sd = saved.state_dict()
    opt, a, p = _two_groups(offload)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"load_state_dict: param group 1 \(muon\), param 0: optimizer state "
                                         r"'second_momentum_buffer' .* has shape \(48, 1\), and row_blocks=\(16, 16\) "
                                         r"needs \(32, 1\)"):
        opt.load_state_dict(sd)
    assert snapshot(opt) == before
    a.grad, p.grad = torch.randn(8, 8), _grads(2)[1]
    opt.step()
    fresh, a, p = _two_groups(offload, beta2=None)
    fresh.load_state_dict(sd)
    assert fresh.param_groups[1]["row_blocks"] == (16, 16)
    assert torch.equal(fresh.state[p]["second_momentum_buffer"], saved.state[saved.param_groups[1]["params"][0]][
        "second_momentum_buffer"])
    a.grad, p.grad = torch.randn(8, 8), _grads(2)[1]
    fresh.step()


def test_block_statistics_shared_by_two_params_are_refused_before_writing():
    """Blocked statistics have a shape of their own (csrc/step_checks.h, StateShape::kGiven): they are checked and
    recorded for the overlap check like every other state tensor."""
    a, b = torch.nn.Parameter(_whole()), torch.nn.Parameter(_whole() + 1)
    opt = MuonAdamW([dict(params=[a, b], row_blocks=SIZES, beta2=0.95, **SETTINGS)])
    a.grad, b.grad = _grads(2)
    opt.step()
    opt.state[b]["second_momentum_buffer"] = opt.state[a]["second_momentum_buffer"]
    before = [a.detach().clone(), b.detach().clone()]
    with pytest.raises(ValueError, match="second_momentum_buffer.*shares memory with"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    opt.state[b]["second_momentum_buffer"] = torch.zeros(3, 1)  # not every block's statistics
    with pytest.raises(ValueError, match="second_momentum_buffer.*has shape"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


# -- DTensor params (2 gloo processes) ------------------------------------------------------------------------------

def _dtensor_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for placement in (Shard(0), Shard(1), Replicate()):
        for spec, scales, beta2 in ((SIZES, None, None), (QKV, None, 0.95), (INDEX_BLOCKS, SCALES, 0.95)):
            ref_param, ref_master = _run(spec, torch.bfloat16, beta2, {}, scales=scales)
            full = _whole().to(torch.bfloat16)
            p = torch.nn.Parameter(distribute_tensor(full, mesh, [placement], src_data_rank=None))
            opt = MuonAdamW([dict(params=[p], row_blocks=spec, row_block_scales=scales, beta2=beta2, **SETTINGS)])
            for g in _grads(3):
                p.grad = distribute_tensor(g.to(torch.bfloat16), mesh, [placement], src_data_rank=None)
                opt.step()
            what = f"{placement} {spec} beta2={beta2}"
            assert torch.equal(p.full_tensor(), ref_param), what
            assert torch.equal(opt.gather_full_parameter_master(p), ref_master), what


def test_dtensor_row_blocks_equal_one_process(tmp_path):
    spawn(tmp_path, 2, _dtensor_cases, timeout_s=180)
