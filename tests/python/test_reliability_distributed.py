"""Distributed reliability repros and cross-rank agreement, in one spawned gloo
world of two ranks (cases in reliability_distributed_cases.py): zero-size
DTensor params, a writer failing on one rank, settings (the lr included),
loads, groups and GradScaler use differing across ranks, row-block scales out
of range on one rank's rows. A hang fails by the join deadline."""

from __future__ import annotations

from support import reliability_distributed_cases as cases
from support.dist_helpers import spawn
from support.helpers import onednn_off


def test_every_call_completes_or_raises_on_every_rank(tmp_path):
    spawn(tmp_path, 2, cases.run_all, timeout_s=240)


def test_cpu_polar_gemm_follows_the_settings_and_encodes_an_invalid_one(monkeypatch):
    """The path agreed on above is read per call: MUON_EXT_CPU_TILE_GEMM=0 turns the tiles off; an invalid
    value becomes a value of its own (so the ranks disagree instead of one raising before the collective)."""
    import torch

    from muon_ext import ops
    from muon_ext.distributed import agreement

    group = {"kind": "muon", "polar_dtype": "bfloat16", "params": [torch.zeros(4, 4)]}
    native = ops.cpu_bf16_gemm() == "native"
    assert agreement._group_cpu_polar_gemm(group) == (ops.cpu_bf16_gemm(), ops.cpu_bf16_tile_gemm(), native)
    # torch's oneDNN switched off: at::addmm sums BF16 elsewhere (native path), so the digest changes there.
    with onednn_off():
        assert agreement.cpu_polar_gemm() == (ops.cpu_bf16_gemm(), "", False)
    assert agreement._group_cpu_polar_gemm(dict(group, polar_dtype="float32")) is None
    assert agreement._group_cpu_polar_gemm(dict(group, kind="adamw")) is None
    monkeypatch.setenv("MUON_EXT_CPU_TILE_GEMM", "0")
    assert agreement.cpu_polar_gemm()[1] == ""
    monkeypatch.setenv("MUON_EXT_CPU_TILE_GEMM", "2")
    kind, message = agreement._group_cpu_polar_gemm(group)
    assert kind == "invalid" and "MUON_EXT_CPU_TILE_GEMM must be '0' or '1'" in message


def test_device_lr_digest_folds_in_every_bit_of_the_lr():
    """The step digest of a capturable (device tensor) lr is computed on the device (no host sync): lrs that
    differ in the exponent only, or in the last mantissa bit, get other codes; groups without one add nothing."""
    import torch

    from muon_ext.distributed import agreement

    codes = {float(v): int(agreement.lr_code(torch.tensor(v))) for v in (0.02, 0.04, 0.08, 1e-3)}
    codes[-1.0] = int(agreement.lr_code(torch.tensor(0.02).view(torch.int32).add(1).view(torch.float32)))
    assert len(set(codes.values())) == len(codes) and all(0 <= c < 1 << 20 for c in codes.values())
    assert int(agreement.lr_code(torch.tensor(0.02))) == codes[0.02]
    assert agreement.device_lr_digest([{"lr": 0.02}, {"lr": torch.tensor(0.02)}], [0, 1], 5, torch.device("cpu")) is None
