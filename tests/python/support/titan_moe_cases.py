"""Bodies of the spawned torchtitan MoE tests (test_torchtitan_moe.py):
torchtitan 0.3.0's qwen3 MoE debug recipe, made small for a CPU
(titan_cpu.qwen3_moe_config: routed experts through torch._grouped_mm, a
top-2 router with the load-balancing expert bias, a shared expert), trained
with MuonAdamW selected from its config (muon_ext.torchtitan.muon_adamw)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from support import titan_cpu
from support.dist_helpers import bits
from support.titan_cases import SAVE_AT, STEPS, _decreasing, _setup, resume_exactly

ROUTED = ("w1_EFD", "w2_EDF", "w3_EFD")


def _seed(folder):
    """The initial model saved by the one-process run: the runs at W = 2 start from it."""
    return os.path.join(folder, "muon", "checkpoint", "step-0")


def _optimizer(trainer):
    (opt,) = trainer.optimizers.optimizers  # one model part, one MuonAdamW
    return opt


def _check_groups(trainer):
    """Routed experts (each a stack under the batch view) and shared experts in Muon groups, the router in AdamW."""
    kinds = {}
    for group in _optimizer(trainer).param_groups:
        for name in group["param_names"]:
            kinds[name] = (group["kind"], group.get("matrix_view"))
    names = [n for n, _ in trainer.model_parts[0].named_parameters()]
    routed = [n for n in names if n.endswith(ROUTED)]
    shared = [n for n in names if ".shared_experts." in n]
    gates = [n for n in names if ".router.gate." in n]
    assert routed and shared and gates, names
    assert all(kinds[n] == ("muon", "batch") for n in routed + shared), kinds
    assert all(kinds[n][0] == "adamw" for n in gates), kinds


def _expert_bias(trainer):
    return [m.expert_bias_E.detach().clone() for m in trainer.model_parts[0].modules()
            if getattr(m, "expert_bias_E", None) is not None]


def single_process(rank, world, folder):
    """One process: MuonAdamW trains the MoE model (finite, falling losses;
    the load-balancing hook moves the expert biases); resumed from
    torchtitan's step-3 checkpoint it ends on the very params, expert biases
    and losses of the run that never stopped. Saves step-0 for the W = 2 runs."""
    assets = _setup(folder)
    config = titan_cpu.qwen3_moe_config(assets, os.path.join(folder, "muon"), optimizer="muon", steps=STEPS,
                                        checkpoint_interval=SAVE_AT)
    trainer, losses = titan_cpu.train(config, seed_checkpoint=True)
    losses = _decreasing(losses, "MuonAdamW MoE")
    _check_groups(trainer)
    biases = _expert_bias(trainer)
    assert biases and all(bool(b.abs().sum() > 0) for b in biases), f"expert biases did not move: {biases}"
    params = titan_cpu.full_params(trainer)
    trainer.close()

    trainer = resume_exactly(folder, lambda out: titan_cpu.qwen3_moe_config(
        assets, out, optimizer="muon", steps=STEPS, checkpoint_interval=100), losses, params)
    for a, b in zip(_expert_bias(trainer), biases):
        assert torch.equal(a, b), "resumed expert bias"
    trainer.close()


def _same_grads_as_one_process(trainer, what, steps=2):
    """A second MuonAdamW with the trainer's groups, on the trainer's DTensor
    params (torchtitan's placements), against one process on full copies,
    given the same (synthetic) full grads: equal bit for bit."""
    from muon_ext import MuonAdamW

    model = trainer.model_parts[0]
    named = dict(model.named_parameters())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in _optimizer(trainer).param_groups]
    plain = {n: torch.nn.Parameter(p.full_tensor().detach().clone()) for n, p in named.items()}
    opt = MuonAdamW([{**g, "params": [named[n] for n in g["param_names"]]} for g in groups])
    ref = MuonAdamW([{**g, "params": [plain[n] for n in g["param_names"]]} for g in groups])
    for step in range(steps):
        gen = torch.Generator().manual_seed(50 + step)
        for name, p in named.items():
            g = torch.randn(p.shape, generator=gen)
            plain[name].grad = g.clone()
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        opt.step()
        ref.step()
    for name, p in named.items():
        assert torch.equal(bits(p.full_tensor()), bits(plain[name])), f"{what}: {name}"
        assert torch.equal(bits(opt.gather_full_parameter_master(p)), bits(ref.get_full_parameter_master(plain[name])))


def parallel(rank, world, folder):
    """W = 2: MuonAdamW under FSDP 2 and under EP 2 (experts Shard(0) over the
    EP dim, everything else FSDP) trains the MoE model from the one-process
    step-0 with finite, falling losses; then, on the params as torchtitan
    placed them, the optimizer equals one process given the same grads; EP 2
    resumed from torchtitan's step-3 checkpoint ends on the very params,
    expert biases and losses of the run that never stopped.
    W = 4: EP 2 x FSDP 2 with 2 experts, so that torchtitan's expert FSDP
    splits each expert's rows (Shard(1) over efsdp, Shard(0) over ep; its own
    initial values: the seed has 4 experts)."""
    assets = _setup(folder)
    placements = {}
    runs = (("fsdp2", 2, 1, 4), ("ep2", 2, 2, 4)) if world == 2 else (("ep2_fsdp2", 4, 2, 2),)
    for name, dp_shard, ep, experts in runs:
        resume = name == "ep2"  # checkpointed at SAVE_AT, resumed below
        config = titan_cpu.qwen3_moe_config(assets, os.path.join(folder, name), optimizer="muon", steps=STEPS,
                                            dp_shard=dp_shard, ep=ep, experts=experts,
                                            checkpoint_interval=SAVE_AT if resume else 0,
                                            initial_load_path=_seed(folder) if experts == 4 else "")
        trainer, losses = titan_cpu.train(config)
        _decreasing(losses, f"MuonAdamW MoE {name}")
        _check_groups(trainer)
        experts = [p for n, p in trainer.model_parts[0].named_parameters() if n.endswith(ROUTED)]
        assert all(isinstance(p, DTensor) for p in experts)
        placements[name] = [(tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.placements)) for p in experts]
        assert all(any(pl.is_shard() for pl in p.placements) for p in experts), placements[name]
        if resume:
            params, biases = titan_cpu.full_params(trainer), _expert_bias(trainer)
            trainer.close()
            trainer = resume_exactly(folder, lambda out: titan_cpu.qwen3_moe_config(
                assets, out, optimizer="muon", steps=STEPS, dp_shard=dp_shard, ep=ep, checkpoint_interval=100),
                [losses[s] for s in sorted(losses)], params, run=name)
            assert all(torch.equal(a, b) for a, b in zip(_expert_bias(trainer), biases)), "resumed expert bias"
        _same_grads_as_one_process(trainer, name)
        trainer.close()
    if rank == 0:
        torch.save({k: [repr(v) for v in vs] for k, vs in placements.items()},
                   os.path.join(folder, f"moe_placements_{world}.pt"))
    dist.barrier()
