"""Benchmark: data-parallel ownership (MuonAdamW(..., data_parallel_group=...)) at W = 2 and 4 processes
(gloo, CPU) against the replicated optimizer (every rank steps every param, as torch.optim.Muon under DDP),
on a GPT's params (d=256, L=4: Muon for the hidden matrices, AdamW for embeddings, head and norms), BF16 +
int16 remainders, the same grads on every rank.

Reports per W and rank: optimizer-state bytes per param (ours against the replicated optimizer's), the
Polar-Express FLOPs the plan gives each rank and their max / mean, the bytes each rank sends per step (the
all_gather of the new params; DDP's grad all_reduce, which both need, is not counted), and seconds per step
(median of interleaved rounds, slowest rank). Both optimizers' params are checked equal.
Usage: python bench/data_parallel.py [--worlds 2,4] [--steps 8] [--out bench/results/data_parallel.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import environment, write_json  # noqa: E402


def _gpt_params(d=256, layers=4, vocab=2048):
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.nn.Parameter((torch.randn(*s, generator=gen) * 0.02).bfloat16())  # noqa: E731
    muon = [make(r, c) for _ in range(layers) for r, c in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]
    adamw = [make(vocab, d), make(vocab, d)] + [make(d) for _ in range(2 * layers + 1)]
    return muon, adamw


def _optimizer(params, **kw):
    import muon_ext

    muon, adamw = params
    return muon_ext.MuonAdamW([dict(params=muon, kind="muon", lr=0.02, weight_decay=0.1, beta2=0.95),
                               dict(params=adamw, kind="adamw", lr=1e-3, weight_decay=0.01)], **kw)


def _worker(rank, world, store, steps, out):
    from muon_ext.distributed.ownership import imbalance, state_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    ours_params, replicated_params = _gpt_params(), _gpt_params()
    ours = _optimizer(ours_params, data_parallel_group=dist.group.WORLD)
    replicated = _optimizer(replicated_params)
    every = [p for ps in ours_params for p in ps], [p for ps in replicated_params for p in ps]
    times = {"ours": [], "replicated": []}
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(*every):
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            q.grad = p.grad.clone()
        for name, opt in (("ours", ours), ("replicated", replicated)) if step % 2 else \
                (("replicated", replicated), ("ours", ours)):
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    assert all(torch.equal(p, q) for p, q in zip(*every)), "ownership changed the result"
    params = sum(p.numel() for p in every[0])
    mine = torch.tensor([state_bytes(ours.state) / params, ours._ownership.bytes_sent / steps], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        loads = ours._ownership.polar_loads()
        result = {"world": world, "params": params,
                  "state_bytes_per_param": [float(g[0]) for g in gathered],
                  "replicated_state_bytes_per_param": state_bytes(replicated.state) / params,
                  "polar_flops_per_rank": loads, "polar_imbalance": imbalance(loads),
                  "bytes_sent_per_step": [float(g[1]) for g in gathered],
                  "step_s": statistics.median(times["ours"][1:]),
                  "replicated_step_s": statistics.median(times["replicated"][1:])}
        import json
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "data_parallel.json"))
    args = parser.parse_args()
    import json

    results = []
    for world in (int(w) for w in args.worlds.split(",")):
        tmp = tempfile.mkdtemp()
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), args.steps, out), nprocs=world,
                           start_method="spawn")
        with open(out) as f:
            results.append(json.load(f))
        r = results[-1]
        print(f"W={world}: state bytes/param per rank {[round(v, 3) for v in r['state_bytes_per_param']]} "
              f"(replicated {r['replicated_state_bytes_per_param']:.3f}), Polar-Express max/mean "
              f"{r['polar_imbalance']:.3f}, MB sent/step {[round(v / 1e6, 2) for v in r['bytes_sent_per_step']]}, "
              f"step {r['step_s'] * 1e3:.1f} ms (replicated {r['replicated_step_s'] * 1e3:.1f} ms)")
    write_json(args.out, {"environment": environment(torch.device("cpu")), "results": results})


if __name__ == "__main__":
    main()
