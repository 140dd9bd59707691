"""Bodies of the spawned torchtitan tests (test_torchtitan.py): torchtitan's
llama3 debug model (2 layers, CPU, gloo) trained with MuonAdamW selected
from its config (muon_ext.torchtitan.muon_adamw) and with torchtitan's AdamW."""

from __future__ import annotations

import math
import os
import shutil

import torch

from support import titan_cpu

STEPS, SAVE_AT = 6, 3


def _setup(folder):
    import torch.distributed as dist

    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    titan_cpu.patch()
    torch.autograd.set_multithreading_enabled(False)  # what torchtitan's init_distributed would do
    return titan_cpu.write_assets(os.path.join(folder, "assets"))


def _seed(folder):
    """The initial model saved by the one-process AdamW run: every MuonAdamW run starts from it."""
    return os.path.join(folder, "adamw", "checkpoint", "step-0")


def _decreasing(losses, what):
    values = [losses[s] for s in sorted(losses)]
    assert len(values) == STEPS and all(math.isfinite(v) for v in values), f"{what}: {values}"
    assert values[-1] < values[0] - 0.1, f"{what}: the loss did not fall: {values}"
    return values


def single_process(rank, world, folder):
    """One process: MuonAdamW and AdamW train (finite, falling losses);
    MuonAdamW resumed from torchtitan's step-3 checkpoint ends on the very
    params and losses of the run that never stopped. Saves the run's params
    and losses for the TP comparison."""
    assets = _setup(folder)
    _, adamw = titan_cpu.train(titan_cpu.llama3_config(assets, os.path.join(folder, "adamw"), optimizer="adamw",
                                                       steps=STEPS, checkpoint_interval=100), seed_checkpoint=True)
    adamw = _decreasing(adamw, "AdamW")
    trainer, muon = titan_cpu.train(titan_cpu.llama3_config(assets, os.path.join(folder, "muon"), optimizer="muon",
                                                            steps=STEPS, checkpoint_interval=SAVE_AT,
                                                            initial_load_path=_seed(folder)))
    muon = _decreasing(muon, "MuonAdamW")
    params = titan_cpu.full_params(trainer)
    trainer.close()
    torch.save({"params": params, "muon": muon, "adamw": adamw}, os.path.join(folder, "single.pt"))

    trainer = resume_exactly(folder, lambda out: titan_cpu.llama3_config(
        assets, out, optimizer="muon", steps=STEPS, checkpoint_interval=100), muon, params)
    trainer.close()


def _pipeline_stage(trainer, params, losses, single, rank):
    """PP = 2, one layer a stage: the stage's MuonAdamW holds exactly its stage's params (the container drops the
    groups that claim none here: no embeddings on the last stage, no output head on the first), and after
    STEPS steps they equal the one-process run's to float rounding; the last stage's losses too."""
    (opt,) = trainer.optimizers.optimizers
    held = {n for g in opt.param_groups for n in g["param_names"]}
    fqns = {n.replace("_checkpoint_wrapped_module.", "") for n in params}  # the activation-checkpoint wrapper's
    assert held == fqns, (rank, sorted(held), sorted(fqns))
    assert f"layers.{rank}.attention.wo.weight" in held, (rank, sorted(held))
    assert ("tok_embeddings.weight" in held) == (rank == 0) and ("lm_head.weight" in held) == (rank == 1), held
    for key, value in params.items():
        ref = single["params"][key]
        err = float((value - ref).norm() / ref.norm())
        assert err < 1e-4, f"PP=2 stage {rank} {key}: relative difference {err:.3g} from one process"
    if rank == 1:
        values = [losses[s] for s in sorted(losses)]
        assert max(abs(a - b) for a, b in zip(values, single["muon"])) < 1e-3, (values, single["muon"])


def resume_exactly(folder, make_config, losses, params, run: str = "muon"):
    """torchtitan resumed (`make_config(out)`) from the step-SAVE_AT checkpoint of the run under
    folder/`run`, whose `losses` (steps 1..STEPS) and final `params` it must end on exactly; returns its trainer.
    Collective (rank 0 copies the checkpoint)."""
    import torch.distributed as dist

    resumed_out = os.path.join(folder, f"resumed_{run}")
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(folder, run, "checkpoint", f"step-{SAVE_AT}"),
                        os.path.join(resumed_out, "checkpoint", f"step-{SAVE_AT}"))
    dist.barrier()
    config = make_config(resumed_out)
    config.checkpoint.load_step = SAVE_AT
    trainer, resumed = titan_cpu.train(config)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1)), sorted(resumed)
    assert [resumed[s] for s in sorted(resumed)] == losses[SAVE_AT:], (resumed, losses)
    for name, value in titan_cpu.full_params(trainer).items():
        assert torch.equal(value, params[name]), f"resumed {name}"
    return trainer


def parallel(rank, world, folder):
    """W = 2: MuonAdamW under FSDP (dp_shard=2) and under TP=2 trains with
    finite, falling losses; at TP=2 and at PP=2 (the same data as one process) the params
    equal the one-process run's to float rounding (TP sums the matmuls in
    another order; the optimizer itself is exact, tests/python/test_distributed.py)."""
    assets = _setup(folder)
    single = torch.load(os.path.join(folder, "single.pt"))
    results = {}
    for name, dp_shard, tp, pp in (("fsdp2", 2, 1, 1), ("tp2", 1, 2, 1), ("pp2", 1, 1, 2)):
        trainer, losses = titan_cpu.train(titan_cpu.llama3_config(assets, os.path.join(folder, name),
                                                                  optimizer="muon", steps=STEPS, dp_shard=dp_shard,
                                                                  tp=tp, pp=pp, initial_load_path=_seed(folder)))
        params = titan_cpu.full_params(trainer)
        if pp > 1:  # each stage's container holds its stage's params; the loss is known on the last stage
            _pipeline_stage(trainer, params, losses, single, rank)
            trainer.close()
            continue
        results[name] = _decreasing(losses, f"MuonAdamW {name}")
        trainer.close()
        if name == "tp2":
            for key, value in params.items():
                ref = single["params"][key]
                err = float((value - ref).norm() / ref.norm())
                assert err < 1e-4, f"TP=2 {key}: relative difference {err:.3g} from one process"
            assert max(abs(a - b) for a, b in zip(results[name], single["muon"])) < 1e-3, (results[name], single)
    if rank == 0:
        torch.save(results, os.path.join(folder, "parallel.pt"))
