"""Sizes and inputs the API accepts at construction or load, checked there:
offload sizes against the memory there is, huge slot sizes that
fit, int16 remainders for quantized params refused with the right reason."""

from __future__ import annotations

import copy

import pytest
import torch

import muon_ext
from support.optimizer_snapshot import snapshot
from test_quantized_params import QuantizedTensor


def _muon_param(seed=0):
    return torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)))


def test_a_slot_numel_beyond_every_muon_element_stages_only_what_it_needs():
    p, ref = _muon_param(), _muon_param()
    opt = muon_ext.MuonAdamW([{"params": [p], "kind": "muon"}], adapters=False, offload="cpu",
                             offload_config=muon_ext.OffloadConfig(slot_numel=2**40))
    plain = muon_ext.MuonAdamW([{"params": [ref], "kind": "muon"}], adapters=False)
    for o, q in ((opt, p), (plain, ref)):
        q.grad = torch.ones(8, 8)
        o.step()
    assert torch.equal(p, ref)
    assert opt._runner.slots[0].buffer.numel() < 4 * 64  # sized for the 64 elements there are


@pytest.mark.parametrize("config", [dict(buffer_count=2**40, slot_numel=64), dict(buffer_count=2**30)])
def test_staging_beyond_the_device_memory_is_refused_at_construction(config):
    with pytest.raises(ValueError, match=r"offload='cpu': cpu memory for offload_config.buffer_count=\d+ staging "
                                         r"slots of 64 matrix elements need up to \d+ bytes, more than"):
        muon_ext.MuonAdamW([{"params": [_muon_param()], "kind": "muon"}], adapters=False, offload="cpu",
                           offload_config=muon_ext.OffloadConfig(**config))


def test_int16_remainders_for_a_quantized_param_are_refused_naming_the_reason():
    q = torch.nn.Parameter(QuantizedTensor.of(torch.randn(4, 4)), requires_grad=True)
    opt = muon_ext.MuonAdamW([{"params": [q], "kind": "muon"}], adapters=False)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["master_param"] = torch.zeros(4, 4, dtype=torch.int16)  # TransformerEngine-style remainders
    before = snapshot(opt)
    with pytest.raises(TypeError, match="this is a quantized param .* load an FP32 master"):
        opt.load_state_dict(sd)
    assert snapshot(opt) == before
