"""The Muon group setting row_blocks: each param's contiguous row blocks are
orthogonalized as separate matrices, each with its own lr scale, bit-equal
to an optimizer whose params are the blocks themselves; bad settings are
refused before any write."""

import pytest
import torch

from muon_ext import MuonAdamW

BLOCKS = (16, 8, 8)


def _run(row_blocks, dtype, steps=3):
    torch.manual_seed(0)
    whole = torch.randn(32, 24).to(dtype)
    grads = [torch.randn(32, 24) for _ in range(steps)]
    settings = dict(kind="muon", lr=0.02, weight_decay=0.1, beta2=None, lr_scale="original")
    if row_blocks:
        p = torch.nn.Parameter(whole.clone())
        opt = MuonAdamW([dict(params=[p], row_blocks=row_blocks, **settings)])
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
        return p.detach(), opt.get_full_parameter_master(p)
    parts = [torch.nn.Parameter(t.clone()) for t in whole.split(BLOCKS)]
    opt = MuonAdamW([dict(params=parts, **settings)])
    for g in grads:
        for part, gpart in zip(parts, g.split(BLOCKS)):
            part.grad = gpart.to(dtype)
        opt.step()
    return torch.cat([q.detach() for q in parts]), torch.cat([opt.get_full_parameter_master(q) for q in parts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_blocks_equal_the_blocks_as_separate_params(dtype):
    param, master = _run(BLOCKS, dtype)
    ref_param, ref_master = _run(None, dtype)
    assert torch.equal(param, ref_param) and torch.equal(master, ref_master)
    whole_param, _ = _run((32,), dtype)  # one block: the plain step, and not the split one
    assert not torch.equal(whole_param, param)


@pytest.mark.parametrize("blocks, beta2, match", [
    ((16, 8), None, "sum to 24 rows"),
    ((16, 0, 16), None, "positive ints"),
    ((), None, "non-empty"),
    (BLOCKS, 0.95, "NorMuon"),
])
def test_bad_row_blocks_are_refused(blocks, beta2, match):
    p = torch.nn.Parameter(torch.randn(32, 24))
    with pytest.raises(ValueError, match=match):
        MuonAdamW([dict(params=[p], kind="muon", row_blocks=blocks, beta2=beta2)])
    opt = MuonAdamW([dict(params=[p], kind="muon", beta2=None)])
    opt.param_groups[0]["row_blocks"] = blocks
    opt.param_groups[0]["beta2"] = beta2
    p.grad = torch.randn(32, 24)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p, before)
